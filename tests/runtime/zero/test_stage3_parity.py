"""ZeRO stage 3 equals stage 0 (= single-process training on the global batch) every step:
losses, gathered parameters and Adam moments, on 2 and 4 real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.runtime.parity import run_parity
from tests.runtime.zero import ranks

STEPS = 20
# every unit partitioned (DeepSpeed's default keeps parameters under 100k elements gathered)
SHARD_ALL: dict[str, Any] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


@pytest.mark.parametrize("gas", [1, 4], ids=["gas1", "gas4"])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("world", [2, 4], ids=["w2", "w4"])
def test_stage3_matches_stage0(dist_pool, world, kind, gas):
    losses = dist_pool(world).run(
        run_parity, kind, gas, 1.0, STEPS, stage=3, atol=1e-5, config_extra=SHARD_ALL
    )
    assert losses[0] == losses[-1]
    assert sum(losses[0][-3:]) < sum(losses[0][:3])


@pytest.mark.parametrize("kind", ["twice", "gpt-ckpt", "gpt-ckpt-nr"])
def test_reused_module_and_activation_checkpointing(dist_pool, kind):
    """A module that runs twice per forward; every block under reentrant and non-reentrant
    activation checkpointing (recomputed forwards inside backward must not release)."""
    dist_pool(2).run(run_parity, kind, 2, 1.0, 8, stage=3, atol=1e-5, config_extra=SHARD_ALL)


def test_param_groups_frozen_layer_and_persistent_units(dist_pool):
    """Two groups with their own lr and weight decay, a frozen first layer, and DeepSpeed's
    default persistence threshold (the tiny model's small units stay gathered)."""
    dist_pool(2).run(run_parity, "gpt", 2, 1.0, 8, stage=3, groups=True, freeze=True, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_matches_stage0(dist_pool, dtype):
    """fp16 (loss scaling) and bf16 with fp32 master shards, within the dtype's tolerance."""
    dist_pool(2).run(ranks.stage_vs_stage0_low_precision, 3, dtype)


def test_fp16_overflow_skips_on_every_rank(dist_pool):
    scales = dist_pool(2).run(ranks.fp16_overflow_skips_everywhere, 3)
    assert scales[0] == scales[1]


def test_no_sync_equals_accumulation(dist_pool):
    dist_pool(2).run(ranks.no_sync_equals_accumulation, 3)


@pytest.mark.parametrize(
    ("gas", "reuse", "gathers"),
    [(1, None, 2), (4, None, 2), (4, 0, 8)],
    ids=["gas1", "gas4-held", "gas4-regather"],
)
@pytest.mark.parametrize("world", [2, 4], ids=["w2", "w4"])
def test_bus_volume_per_step(dist_pool, world, gas, reuse, gathers):
    """Per optimizer step the parameters are all-gathered for a forward and a backward and
    the accumulated gradients reduce-scattered once: 3Ψ(N-1)/N elements, ZeRO-3's figure, with
    or without accumulation (the parameters stay gathered between micro-steps when they fit in
    stage3_max_live_parameters and stage3_max_reuse_distance). With a reuse distance of 0 every
    micro-step gathers again, as DeepSpeed does: (2 gas + 1)Ψ(N-1)/N."""
    zero = {} if reuse is None else {"stage3_max_reuse_distance": reuse}
    for result in dist_pool(world).run(ranks.comm_bus_bytes_per_step, 3, gas, 3, zero):
        expected = (gathers + 1) * result["params"] * (world - 1) / world * 4  # fp32
        assert result["bus_bytes"] == pytest.approx(expected, rel=0.05)


def test_safe_accessors(dist_pool):
    """safe_get/set_* read and write stage 3's partitioned parameters, gradients and state."""
    dist_pool(2).run(ranks.accessors, 3)


def test_optimizer_sub_groups(dist_pool):
    """sub_group_size: the optimizer steps a few hundred elements at a time, same result."""
    extra = {"zero_optimization": {**SHARD_ALL["zero_optimization"], "sub_group_size": 300}}
    pool = dist_pool(2)
    pool.run(run_parity, "mlp", 1, 1.0, 6, stage=3, groups=True, atol=1e-5, config_extra=extra)
