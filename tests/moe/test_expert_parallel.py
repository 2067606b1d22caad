"""Expert parallelism is exact: the MoE layer and a GPT-MoE trained by the engine at
``ep_size`` 1, 2 and 4 on 4 gloo ranks equal a single-process ``ep_size=1`` reference."""

from __future__ import annotations

import pytest
import torch

from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.moe import ep_ranks


@pytest.mark.parametrize(
    ("k", "drop_tokens", "ragged"),
    [(1, True, False), (2, True, False), (1, False, False), (2, False, True), (1, True, True)],
)
def test_layer_equals_all_experts_local(dist_pool, k: int, drop_tokens: bool, ragged: bool):
    checked = dist_pool(4).run(ep_ranks.layer_parity, k, drop_tokens, ragged)
    assert checked[0] == [1, 2, 4]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_engine_equals_single_process(dist_pool, stage: int, ep_size: int):
    losses = dist_pool(4).run(ep_ranks.engine_parity, stage, ep_size)
    assert losses[0] == losses[-1]
    assert losses[0][-1] < losses[0][0]


def test_gradients_exact_with_accumulation(dist_pool):
    """No clipping: every reduced gradient (expert and dense) equals the reference's, with
    gradient accumulation, at expert 2 x data 2."""
    pool = dist_pool(4)
    pool.run(ep_ranks.engine_parity, 2, 2, steps=4, gas=2, clip=0.0)
    pool.run(ep_ranks.engine_parity, 0, 4, steps=3, clip=0.0, moe={"k": 1, "drop_tokens": False})


@pytest.mark.parametrize("saved_stage", [0, 2])
def test_checkpoint_resumes_at_other_expert_and_data_parallel_sizes(
    dist_pool, tmp_path, saved_stage: int
):
    """Saved by expert 2 x data 2 (4 ranks), resumed in parity on 2 ranks at ep_size 2, on 4
    ranks at ep_size 4 and at ep_size 1, and under another ZeRO stage."""
    save_dir = str(tmp_path)
    dist_pool(4).run(ep_ranks.engine_parity, saved_stage, 2, steps=3, save_dir=save_dir)
    names = {p.name for p in (tmp_path / "t").iterdir()}
    # DeepSpeed's expert layout: 2 MoE layers x 4 experts, beside the dense model states
    expert_files = {
        f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in (0, 1) for e in range(4)
    }
    assert expert_files <= names
    # zero_to_fp32 puts the experts back: the whole ep_size=1 model, as the reference has it
    consolidated = get_fp32_state_dict_from_zero_checkpoint(save_dir, "t")
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)["model"]
    assert consolidated.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(consolidated[name], value, rtol=1e-5, atol=2e-5, msg=name)
    # so does save_16bit_model (the experts gathered from the expert-parallel peers)
    weights = torch.load(tmp_path / "model16.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=2e-5, msg=name)
    resume = {"steps": 3, "first_step": 3, "load_dir": save_dir}
    dist_pool(2).run(ep_ranks.engine_parity, 2 - saved_stage // 2, 2, **resume)
    dist_pool(4).run(ep_ranks.engine_parity, saved_stage, 4, **resume)
    dist_pool(4).run(ep_ranks.engine_parity, 1, 1, **resume)


@pytest.mark.parametrize(("dtype", "stage"), [("bf16", 2), ("fp16", 1), ("bf16", 3)])
def test_half_precision_expert_parallel_follows_replicated_experts(dist_pool, dtype, stage):
    """bf16 / fp16 (loss scaling): ep_size 2 follows the all-experts-local run within
    half-precision rounding, and trains."""
    pool = dist_pool(2)
    parallel = pool.run(ep_ranks.precision_run, dtype, 2, stage)[0]
    replicated = pool.run(ep_ranks.precision_run, dtype, 1, stage)[0]
    assert parallel == pytest.approx(replicated, rel=2e-2)
    assert parallel[-1] < parallel[0]


def test_group_layouts_and_data_before_expert_order(dist_pool):
    """DeepSpeed's rank layout: expert-parallel ranks consecutive by default, expert-data-
    parallel ranks consecutive with use_data_before_expert_parallelism (which trains in parity
    too)."""
    pool = dist_pool(4)
    default = pool.run(ep_ranks.group_layout, False)
    assert default == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    swapped = pool.run(ep_ranks.group_layout, True)
    assert swapped == [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])]
    pool.run(ep_ranks.data_before_expert_parity)
    pool.run(ep_ranks.group_layout, False)  # the default order again for later tests


def test_zero3_runs_all_experts_local(dist_pool):
    """ZeRO-3 partitions an ep_size=1 MoE model like any other (same losses as stage 0);
    expert parallelism at ZeRO-3 is tests/moe/test_ep_zero3.py's."""
    pool = dist_pool(2)
    assert pool.run(ep_ranks.stage_losses, 3, 1)[0] == pytest.approx(
        pool.run(ep_ranks.stage_losses, 0, 1)[0], rel=1e-5
    )


def test_expert_optimizer_groups_train_and_resume(dist_pool, tmp_path):
    """Experts in optimizer groups of their own (configure_moe_param_groups): the same training,
    and a checkpoint saved at ep 2 (ZeRO 1) resumes at ep 4 (ZeRO 2) with the groups."""
    pool = dist_pool(4)
    save = {"steps": 3, "save_dir": str(tmp_path), "moe_param_groups": True}
    pool.run(ep_ranks.engine_parity, 1, 2, **save)
    resume = {"steps": 3, "first_step": 3, "load_dir": str(tmp_path), "moe_param_groups": True}
    pool.run(ep_ranks.engine_parity, 2, 4, **resume)


@pytest.mark.timeout(240)
def test_expert_parallel_checkpoint_through_the_planner(dist_pool, tmp_path):
    """ep 2 on 2 ranks (ZeRO 1) saved, resumed in parity on 2 ranks at ep 2 under ZeRO 2 through
    the one reader (engine_parity checks its plan); the record edited so an expert's weight
    has another shape is refused naming it."""
    pool = dist_pool(2)
    pool.run(ep_ranks.engine_parity, 1, 2, steps=2, save_dir=str(tmp_path))
    pool.run(ep_ranks.engine_parity, 2, 2, steps=2, first_step=2, load_dir=str(tmp_path))
    pool.run(ep_ranks.expert_record_checked, str(tmp_path))


def test_deepspeed_moe_layout_loads_its_expert_weights(dist_pool, tmp_path):
    """DeepSpeed's MoE checkpoints have only the layout: a module state without experts and
    layer_<L>_expert_<E> files keyed by ep_size=1 names (no shardspeed record, no manifest).
    Their expert weights are found by the files and load at another ep_size."""
    dist_pool(4).run(ep_ranks.engine_parity, 0, 2, steps=2, save_dir=str(tmp_path))
    tag = tmp_path / "t"
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    del states["moe_experts"]  # what shardspeed adds; DeepSpeed's file does not have it
    del states["shardspeed_plan"]  # nor this
    assert not any("deepspeed_experts" in name for name in states["module"])
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    (tag / "manifest.json").unlink()  # DeepSpeed writes none
    for name in tag.glob("layer_*_optim_states.pt"):
        name.unlink()  # nor these
    compared = dist_pool(2).run(ep_ranks.load_weights_only, str(tmp_path), 2)
    assert compared[0] > 0
