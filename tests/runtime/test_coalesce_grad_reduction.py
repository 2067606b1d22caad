"""engine.coalesce_grad_reduction(): N backward calls, one reduction on exit, same result."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardspeed
from shardspeed import comm
from shardspeed.zero import GatheredParameters
from tests.runtime.parity import MLP, adamw_config

REDUCE_OPS = ("all_reduce", "reduce_scatter_tensor")


def _reductions() -> int:
    volume = comm.get_comm_volume()
    return sum(volume[op]["count"] for op in REDUCE_OPS if op in volume)


def two_backwards_per_step(stage: int) -> dict[str, object]:
    """Train 3 steps with two losses per step, reducing per backward and coalesced."""
    torch.manual_seed(0)
    model = MLP(width=16)
    zero = {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0}
    config = adamw_config(4, 1, 1.0, zero_optimization=zero)
    per_backward, *_ = shardspeed.initialize(model=copy.deepcopy(model), config=config)
    coalesced, *_ = shardspeed.initialize(model=copy.deepcopy(model), config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    counts = {"per_backward": 0, "coalesced": 0}
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 1, generator=gen)
        comm.reset_comm_volume()
        per_backward.backward(per_backward(x[:2], y[:2]))
        per_backward.backward(per_backward(x[2:], y[2:]))
        counts["per_backward"] += _reductions()
        per_backward.step()
        comm.reset_comm_volume()
        with coalesced.coalesce_grad_reduction():
            coalesced.backward(coalesced(x[:2], y[:2]))
            coalesced.backward(coalesced(x[2:], y[2:]))
            assert _reductions() == 0  # nothing reduced inside the block
        counts["coalesced"] += _reductions()
        coalesced.step()
    params = [*per_backward.module.parameters(), *coalesced.module.parameters()]
    with GatheredParameters(params):  # stage 3 holds shards
        max_diff = max(
            (p - q).abs().max().item()
            for p, q in zip(
                per_backward.module.parameters(), coalesced.module.parameters(), strict=True
            )
        )
    with pytest.raises(RuntimeError, match="after it"), coalesced.coalesce_grad_reduction():
        coalesced.step()
    with pytest.raises(RuntimeError, match="nested"), coalesced.coalesce_grad_reduction():
        with coalesced.coalesce_grad_reduction():
            pass
    if coalesced.optimizer.strategy.supports_no_sync:
        with pytest.raises(RuntimeError, match="no_sync"), coalesced.no_sync():
            with coalesced.coalesce_grad_reduction():
                pass
    per_backward.destroy()
    coalesced.destroy()
    return {"max_diff": max_diff, **counts}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_coalesced_reduction_matches_per_backward_reduction(dist_pool, stage):
    result = dist_pool(2).run(two_backwards_per_step, stage)[0]
    assert result["max_diff"] < 1e-6
    assert result["coalesced"] * 2 == result["per_backward"] > 0
