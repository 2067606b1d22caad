"""TRL's trainers with a ZeRO-3 reference model (DPO, KTO, GRPO and RLOO with ``beta > 0``) on
shardspeed, and TRL's ZeRO-3 generation path (``unwrap_model_for_generation`` gathering the
model and taking the hooks off through ``engine.optimizer.parameter_offload``).

TRL's ``prepare_deepspeed`` builds the reference model's engine from the policy's config plus
dotted top-level keys meaning nested overrides (``"zero_optimization.reduce_bucket_size":
hidden * hidden``, ``...stage3_prefetch_bucket_size: 0.9 * hidden * hidden``). DeepSpeed
ignores them; shardspeed applies each as the override it names (one log line) and still refuses
a dotted key that names no real key, with the closest valid one. One ``torchrun`` launch (2 CPU
ranks, the compatibility package installed) runs ``scripts/trl_reference.py``: a tiny Llama
and a word-level tokenizer built locally, 2 steps of each trainer. At the first step the policy
and the reference are the same weights in two ZeRO-3 engines, so DPO's loss is exactly
``log 2``, KTO's, GRPO's and RLOO's KL are 0. GRPO and RLOO generate with
``ds3_gather_for_generation=True``; the ``unwrap`` case checks that path's tokens and the
training after it exactly.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError
from tests.hf.conftest import launch_cmd, rank_env, run_launched

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hf_common import ds_config  # noqa: E402

HIDDEN = 32  # scripts/trl_reference.py's model
CASES = ("dpo", "kto", "grpo", "rloo")
#: scripts/trl_reference.py's case running TRL's unwrap_model_for_generation on its own
UNWRAP = "unwrap"
#: GRPO with TRL's default settings (its beta: no reference model)
DEFAULT_GRPO = "grpo_default"


def trl_overrides(hidden: int) -> dict[str, Any]:
    """What ``trl.models.utils.prepare_deepspeed`` adds to a ZeRO-3 config, as TRL 1.16 writes it."""
    return {
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden * hidden,
    }


def accelerate_filled_z3() -> dict[str, Any]:
    """A ZeRO-3 config as Accelerate hands it to TRL: the "auto" values filled in."""
    config = ds_config(3, config_optimizer=False)
    zero = config["zero_optimization"]
    zero.update(
        reduce_bucket_size=500, stage3_prefetch_bucket_size=400,
        stage3_param_persistence_threshold=300,
    )  # fmt: skip
    config.update(
        train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
        gradient_clipping=1.0, steps_per_print=float("inf"), fp16={"enabled": False},
        bf16={"enabled": False},
    )  # fmt: skip
    return config


@pytest.fixture
def shardspeed_log() -> Iterator[list[str]]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardspeed").addHandler(handler)
    yield records
    logging.getLogger("shardspeed").removeHandler(handler)


def test_dotted_keys_are_nested_overrides(shardspeed_log: list[str]) -> None:
    config = {**accelerate_filled_z3(), **trl_overrides(64)}
    cfg = DeepSpeedConfig(config, dp_world_size=2)
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 64 * 64
    assert zero.param_persistence_threshold == 640
    # an element count given as 0.9 * 64 * 64 = 3686.4 rounds down, and the log says so
    assert zero.prefetch_bucket_size == 3686
    (line,) = [r for r in shardspeed_log if "dotted top-level keys" in r]
    assert "zero_optimization.reduce_bucket_size=4096" in line and "(from 3686.4)" in line
    # engine.config.get() (what clients read back) sees the override in its section
    assert cfg.get("zero_optimization")["reduce_bucket_size"] == 4096
    assert "zero_optimization.reduce_bucket_size" not in cfg.raw
    # the caller's dict is left as it was given
    assert config["zero_optimization"]["reduce_bucket_size"] == 500
    assert "zero_optimization.reduce_bucket_size" in config
    # the override replaces the key under any of its names (an alias in the section)
    aliased = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
               "prefetch_bucket_size": 10}, "zero_optimization.stage3_prefetch_bucket_size": 20}  # fmt: skip
    assert DeepSpeedConfig(aliased, dp_world_size=1).zero_optimization.prefetch_bucket_size == 20
    # a section the config does not have yet is created
    fp16 = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "fp16.enabled": True})
    assert fp16.fp16.enabled


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            "zero_optimization.reduce_bucket_sise",
            "Unknown key 'zero_optimization.reduce_bucket_sise'; did you mean "
            "'reduce_bucket_size'?",
        ),
        (
            "zero_optimization.offload_param.devise",
            "Unknown key 'zero_optimization.offload_param.devise'; did you mean 'device'?",
        ),
        ("zero_optimisation.stage", "Unknown key 'zero_optimisation.stage'; did you mean"),
        ("zero_optimization.stage.x", "'zero_optimization.stage' is a value, not a section"),
    ],
)
def test_dotted_typos_are_refused(key: str, message: str) -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, key: 1}, dp_world_size=1)
    assert message in str(info.value)


def _results(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        case: [json.loads((out / case / f"rank{r}.json").read_text()) for r in (0, 1)]
        for case in CASES
    }


@pytest.mark.timeout(300)
def test_reference_models_at_zero3(compat_site: Path, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    cmd = launch_cmd(
        "torchrun",
        "trl_reference.py",
        str(tmp_path),
        "--cases",
        ",".join((*CASES, DEFAULT_GRPO, UNWRAP)),
    )
    run_launched(cmd, rank_env(compat_site), timeout=280)
    # GRPO with TRL's defaults: no reference model, generation on the gathered model, training
    default = [json.loads((tmp_path / DEFAULT_GRPO / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in default:
        assert result["ref_engine"] is None and result["engine"] == "DeepSpeedEngine"
        assert result["hooks_removed"] >= 2  # generate() ran gathered, the hooks off, each step
        assert [log["step"] for log in result["logs"]] == [1, 2]
    assert [log["loss"] for log in default[0]["logs"]] == [
        log["loss"] for log in default[1]["logs"]
    ]
    buckets = {
        "reduce_bucket_size": HIDDEN * HIDDEN,
        "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
        "stage3_param_persistence_threshold": 10 * HIDDEN,
    }
    for case, ranks in _results(tmp_path).items():
        for result in ranks:
            # a second ZeRO-3 engine, without an optimizer, built with TRL's overrides
            assert result["ref_engine"] == "DeepSpeedEngine" and result["ref_stage"] == 3, case
            assert not result["ref_has_optimizer"] and result["ref_buckets"] == buckets, case
            assert result["engine"] == "DeepSpeedEngine", case
        first, second = ranks[0]["logs"]
        assert [log["step"] for log in ranks[0]["logs"]] == [1, 2], case
        # the logged metrics are gathered: every rank logged the same
        assert ranks[1]["logs"][0]["loss"] == first["loss"], case
        if case == "dpo":  # policy == reference at step 1: every log-ratio is 0
            assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
            assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
            assert second["rewards/chosen"] != 0.0  # the policy moved, the reference did not
        elif case == "kto":
            assert first["kl"] == pytest.approx(0.0, abs=1e-6)
            assert first["loss"] == pytest.approx(0.5, abs=1e-6)
            assert second["rewards/chosen"] != 0.0
        elif case == "rloo":  # generates through the gathered path, as GRPO; the KL grows
            assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 0.0
            assert first["grad_norm"] > 0.0 and first["completions/mean_length"] > 0
            assert all(result["hooks_removed"] >= 2 for result in ranks), case
        else:  # grpo, beta > 0: the KL to the reference is 0, then grows
            assert first["kl"] == pytest.approx(0.0, abs=1e-6)
            assert second["kl"] > 0.0
            # generate() ran on the gathered model with the hooks off (once per step)
            assert all(result["hooks_removed"] >= 2 for result in ranks), case
    unwrap = [json.loads((tmp_path / UNWRAP / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in unwrap:
        # TRL's remove_hooks / add_hooks ran on parameter_offload: the hooks were off during
        # generate(), which gathered nothing, and came back as many as before
        assert result["trl_calls"] == [1, 1]
        assert result["hooks"][1] == 0 and result["hooks"][0] == result["hooks"][2] > 0
        assert result["gathers_in_generate"] == 0
        # the same tokens as the gathered weights in a plain model in one process
        assert result["tokens"] == result["expected"]
        # training after it: the engine that generated equals the one that did not, exactly
        with_generate, without = result["losses"]
        assert with_generate == without and len(with_generate) == 3
        assert result["weights_equal"] and result["weights_moved"]
    assert unwrap[0]["tokens"] == unwrap[1]["tokens"]
