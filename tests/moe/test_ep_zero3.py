"""Expert parallelism under ZeRO stage 3 (DeepSpeed refuses it): expert parameters sharded over
their expert-data-parallel group, dense ones over data parallel. The GPT-MoE at (ep 2, 2 ranks)
and (ep 2 x data 2, 4 ranks, built under ``zero.Init``) and AutoEP's Qwen3-MoE equal the
single-process ``ep_size=1`` run step by step (losses, clipped gradient norm, every parameter),
and their checkpoints resume in the other configurations and at ZeRO 0 on one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.moe import ep_zero3_ranks

STEPS, RESUMED = 10, 3


def _assert_whole_model(folder: Path) -> None:
    """zero_to_fp32 and save_16bit_model give the whole ``ep_size=1`` model, as the reference
    has it (every expert gathered from the ranks holding its shards)."""
    reference = torch.load(folder / "reference.pt", weights_only=True)["model"]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(folder, "t")
    weights = torch.load(folder / "model16.pt", weights_only=True)
    assert consolidated.keys() == reference.keys() == weights.keys()
    for name, value in reference.items():
        torch.testing.assert_close(consolidated[name], value, rtol=1e-5, atol=2e-5, msg=name)
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=2e-5, msg=name)


@pytest.fixture(scope="module")
def gpt_checkpoints(dist_pool, tmp_path_factory) -> dict[str, Path]:
    """The GPT-MoE trained 10 steps at ZeRO 3 with clipping, and saved: ``ep2`` on 2 ranks
    (every parameter gathered around its use; the experts are whole on each rank) and
    ``ep2_dp2`` on 4 ranks (the experts sharded over 2 ranks), built under ``zero.Init``,
    its LayerNorms kept gathered (``stage3_param_persistence_threshold``)."""
    root = tmp_path_factory.mktemp("ep_zero3")
    folders = {"ep2": root / "ep2", "ep2_dp2": root / "ep2_dp2"}
    losses = dist_pool(2).run(ep_zero3_ranks.gpt, 3, 2, steps=STEPS, save_dir=str(folders["ep2"]))
    assert losses[0][-1] < losses[0][0]
    losses = dist_pool(4).run(
        ep_zero3_ranks.gpt,
        3,
        2,
        threshold=60,
        steps=STEPS,
        zero_init="build",
        save_dir=str(folders["ep2_dp2"]),
    )
    assert losses[0][-1] < losses[0][0]
    return folders


@pytest.mark.timeout(400)
def test_gpt_moe_zero3_equals_single_process_and_saves_expert_layout(gpt_checkpoints):
    for folder in gpt_checkpoints.values():
        names = {p.name for p in (folder / "t").iterdir()}
        # DeepSpeed's expert layout: 2 MoE layers x 4 experts, whatever the sharding
        assert {
            f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in (0, 1) for e in range(4)
        } <= names
        _assert_whole_model(folder)


@pytest.mark.timeout(300)
def test_gpt_moe_zero3_checkpoints_resume_in_the_other_configurations(dist_pool, gpt_checkpoints):
    """Each checkpoint resumes in the other ZeRO-3 configuration and at ZeRO 0 on one rank. On
    4 ranks the model was partitioned over all 4 by ``zero.Init(module=...)`` first, so
    initialize re-partitions its experts over their expert-data-parallel group; on 2 ranks
    without clipping, so every reduced gradient, expert and dense, is compared too, with each
    MoE layer a ZeRO-3 leaf (one gather unit holding dense and expert parameters)."""
    resume = {"steps": RESUMED, "first_step": STEPS}
    four = {**resume, "zero_init": "module", "load_dir": str(gpt_checkpoints["ep2"])}
    dist_pool(4).run(ep_zero3_ranks.gpt, 3, 2, **four)
    two = {**resume, "clip": 0.0, "leaf_moe": True, "load_dir": str(gpt_checkpoints["ep2_dp2"])}
    dist_pool(2).run(ep_zero3_ranks.gpt, 3, 2, **two)
    for folder in gpt_checkpoints.values():  # ZeRO 0, one rank, every expert local
        dist_pool(1).run(ep_zero3_ranks.gpt, 0, 1, load_dir=str(folder), **resume)


@pytest.mark.timeout(400)
def test_autoep_zero3_equals_single_process_and_resumes(dist_pool, tmp_path):
    """AutoEP at ZeRO 3 on 2 ranks (clipping) saved; resumed on 4 ranks (autoep 2 x data 2,
    the model partitioned by zero.Init before AutoEP slices its experts) and at ZeRO 0 on one
    rank with every expert local."""
    folder = str(tmp_path)
    losses = dist_pool(2).run(ep_zero3_ranks.autoep, 3, 2, STEPS, save_dir=folder)
    assert losses[0][-1] < losses[0][0]
    assert "layer_0_expert_3_mp_rank_00_model_states.pt" in {
        p.name for p in (tmp_path / "t").iterdir()
    }
    _assert_whole_model(tmp_path)
    resume = {"first_step": STEPS, "load_dir": folder}
    dist_pool(4).run(ep_zero3_ranks.autoep, 3, 2, RESUMED, partitioned=True, **resume)
    dist_pool(1).run(ep_zero3_ranks.autoep, 0, 1, RESUMED, **resume)
