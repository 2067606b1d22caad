"""Data efficiency through the engine (one-rank pool): the legacy seqlen curriculum's lengths
per step for every schedule type, random-LTD's kept tokens per step in the chosen layers and a
small GPT that still learns, checkpoint resume of every scheduler, the curriculum loader, and
config errors that name the key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer, seqlen_metric
from tests.runtime.data_pipeline import de_ranks
from tests.runtime.data_pipeline.test_analyzer_and_sampler import PAD, Tokens

SEQ = de_ranks.SEQ


def _root(step: int, low: int, high: int, total: int, dstep: int, degree: float) -> int:
    value = math.floor((step / total) ** (1 / degree) * (high - low) + low)
    value -= value % dstep
    return min(max(value, -(-low // dstep) * dstep), high)


# -- legacy seqlen curriculum ------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["fixed_linear", "fixed_root", "fixed_discrete", "custom"])
def test_legacy_seqlen_lengths_per_step(dist_pool, kind: str) -> None:
    steps = 8
    sched: dict[str, Any] = {"total_curriculum_step": 6, "difficulty_step": 4}
    if kind == "fixed_root":
        sched["root_degree"] = 2
    if kind == "fixed_discrete":
        sched = {"difficulty": [8, 16, 24], "max_step": [2, 4]}
    legacy = {
        "min_difficulty": 8,
        "max_difficulty": SEQ,
        "schedule_type": kind,
        "schedule_config": sched,
    }
    if kind == "custom":
        legacy.pop("schedule_config")
    (seen,) = dist_pool(1).run(de_ranks.legacy_lengths, legacy, steps, kind == "custom")
    # the forward of step t (0-based) runs with the schedule at global_steps + 1 = t + 1
    if kind in ("fixed_linear", "fixed_root"):
        degree = 2 if kind == "fixed_root" else 1
        expected = [_root(t + 1, 8, SEQ, 6, 4, degree) for t in range(steps)]
    elif kind == "fixed_discrete":
        expected = [8, 8, 16, 16, 24, 24, 24, 24]
    else:
        expected = [min(SEQ, 4 * (t + 1) + 4) for t in range(steps)]
    assert seen == expected + [SEQ]  # the evaluation forward sees the whole sequence
    assert seen[0] < SEQ


@pytest.mark.timeout(240)
def test_legacy_seqlen_needs_the_keyword(dist_pool) -> None:
    (message,) = dist_pool(1).run(de_ranks.legacy_without_keyword)
    assert "curriculum_seqlen" in message and "NoSeqlenGPT" in message


# -- random-LTD ------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_random_ltd_drops_the_scheduled_tokens_and_the_model_learns(dist_pool) -> None:
    steps = 40
    pool = dist_pool(1)
    (out,) = pool.run(de_ranks.random_ltd_trains, steps)
    (dense,) = pool.run(de_ranks.dense_trains, steps)
    full = SEQ - 1
    expected = [
        min(max(math.floor(t / 6 * (full - 8) + 8) // 4 * 4, 8), full) for t in range(steps)
    ]
    assert out["scheduled"] == expected and expected[0] == 8 and expected[-1] == full
    assert out["configured"] == [1, 2]
    for block in (1, 2):  # the chosen layers see the scheduled count at each step
        assert out["seen"][block] == expected
    for block in (0, 3):
        assert out["seen"][block] == [full] * steps
    consumed = sum(4 * (k * 2 + full * 2) for k in expected)
    assert out["state"]["consumed_layer_tokens"] == consumed
    losses = out["losses"]
    assert sum(losses[-5:]) / 5 < 0.2 * sum(losses[:5]) / 5  # still learns (3.1 -> 0.33)
    assert sum(losses[-5:]) / 5 < sum(dense[-5:]) / 5 + 0.25  # near the dense model (0.31)


# -- checkpoints ----------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 3])
def test_resume_restores_scheduler_state_exactly(dist_pool, tmp_path: Path, stage: int) -> None:
    # the wrappers convert_to_random_ltd inserts after initialize rename the parameters: the
    # checkpoint (ZeRO-3's partitioned one too) must carry the new names
    (out,) = dist_pool(1).run(de_ranks.resume, str(tmp_path), stage)
    assert out["restored"]
    assert out["client"]["mine"] == 1
    assert not {"random_ltd", "curriculum_scheduler_legacy", "data_sampler"} & set(out["client"])
    unbroken, resumed = out["unbroken"], out["resumed"]
    assert resumed["seen"] == unbroken["seen"] == [min(SEQ, 8 + 4 * s) for s in (4, 5, 6)]
    assert resumed["ltd"] == unbroken["ltd"] and resumed["legacy"] == unbroken["legacy"]
    assert resumed["losses"] == pytest.approx(unbroken["losses"], rel=1e-5)


@pytest.mark.timeout(240)
def test_curriculum_loader_through_the_engine(dist_pool, tmp_path: Path) -> None:
    data = Tokens()
    DataAnalyzer(
        data,
        batch_size=8,
        metric_names=["seqlen"],
        metric_functions=[seqlen_metric(PAD)],
        metric_types=["single_value_per_sample"],
        save_path=str(tmp_path),
    ).run()
    metric = {
        "index_to_sample_path": str(tmp_path / "seqlen" / "seqlen_index_to_sample"),
        "index_to_metric_path": str(tmp_path / "seqlen" / "seqlen_index_to_metric"),
        "difficulty_type": "value",
        "min_difficulty": 4,
        "max_difficulty": 16,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 2},
    }
    (out,) = dist_pool(1).run(
        de_ranks.curriculum_loader, str(tmp_path), str(tmp_path / "ckpt"), data, metric
    )
    assert out["kind"] == "CurriculumDataLoader"
    for rows, difficulty in zip(out["batches"], out["difficulties"], strict=True):
        lengths = [(torch.tensor(r) != PAD).sum().item() for r in rows]
        assert len(rows) == 2 and max(lengths) <= difficulty
    assert out["difficulties"][0] < 16 and out["difficulties"][-1] == 16
    assert out["again"] == out["batches"][6:]  # the sampler resumed where it was saved


# -- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("section", "key"),
    [
        (
            {
                "curriculum_learning": {
                    "enabled": True,
                    "min_difficulty": 8,
                    "max_difficulty": 64,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"total_curriculum_step": 10},
                }
            },
            "difficulty_step",
        ),
        (
            {
                "curriculum_learning": {
                    "enabled": True,
                    "min_difficulty": 8,
                    "max_difficulty": 64,
                    "schedule_type": "fixed_cubic",
                }
            },
            r"curriculum_learning\.schedule_type",
        ),
        ({"curriculum_learning": {"enabeld": True}}, r"curriculum_learning\.enabeld"),
        (
            {
                "data_efficiency": {
                    "data_routing": {
                        "random_ltd": {**de_ranks.LTD, "enabled": True, "random_ltd_layer_id": [1]}
                    }
                }
            },
            "random_ltd_layer_num",
        ),
        (
            {
                "data_efficiency": {
                    "data_routing": {
                        "random_ltd": {**de_ranks.LTD, "enabled": True, "hidden_state_order": "bsh"}
                    }
                }
            },
            r"random_ltd\.hidden_state_order",
        ),
        (
            {
                "data_efficiency": {
                    "data_sampling": {
                        "curriculum_learning": {
                            "curriculum_metrics": {"m": {"difficulty_type": "rank"}}
                        }
                    }
                }
            },
            r"curriculum_metrics\.m\.difficulty_type",
        ),
        (
            {
                "data_efficiency": {
                    "data_sampling": {
                        "curriculum_learning": {
                            "curriculum_metrics": {
                                "m": {
                                    "min_difficulty": 1,
                                    "max_difficulty": 2,
                                    "schedule_type": "fixed_linear",
                                    "schedule_config": {
                                        "total_curriculum_step": 1,
                                        "difficulty_step": 1,
                                    },
                                }
                            }
                        }
                    }
                }
            },
            "index_to_sample_path",
        ),
        (
            {"data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True}}}},
            "curriculum_metrics",
        ),
    ],
)
def test_bad_config_names_the_key(section: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        DeepSpeedConfig({"train_batch_size": 1, **section}, dp_world_size=1)


def test_sections_parse_with_defaults() -> None:
    cfg = DeepSpeedConfig({"train_batch_size": 1}, dp_world_size=1)
    assert not cfg.data_efficiency.curriculum_enabled and not cfg.data_efficiency.random_ltd_enabled
    assert cfg.data_efficiency.seed == 1234 and cfg.data_efficiency.data_sampling.num_epochs == 1000
    assert not cfg.curriculum_learning.enabled
    on = DeepSpeedConfig(
        {
            "train_batch_size": 1,
            "data_efficiency": {
                "enabled": True,
                "data_routing": {"enabled": True, "random_ltd": {**de_ranks.LTD, "enabled": True}},
            },
        },
        dp_world_size=1,
    )
    assert on.data_efficiency.random_ltd_enabled
    assert on.data_efficiency.data_routing.random_ltd.random_ltd_schedule.min_value == 8


def test_a_damaged_checkpoint_state_names_its_key() -> None:
    from shardspeed.runtime.data_pipeline.engine_hooks import DataEfficiencyHooks

    legacy = {
        "min_difficulty": 8,
        "max_difficulty": 32,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8},
    }
    cfg = DeepSpeedConfig(de_ranks.config(legacy, de_ranks.LTD), dp_world_size=1)
    hooks = DataEfficiencyHooks(cfg, 4, 4)
    good = hooks.state_dict(None)
    hooks.load_state_dict(good, None)  # a well-formed state loads
    with pytest.raises(ValueError, match="'random_ltd' state cannot be restored"):
        hooks.load_state_dict({"random_ltd": {"no": "such keys"}}, None)
    with pytest.raises(ValueError, match="'curriculum_scheduler_legacy' state"):
        hooks.load_state_dict({"curriculum_scheduler_legacy": ["not", "a", "dict"]}, None)
