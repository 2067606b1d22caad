"""ZeRO-3 releases a gathered parameter without touching tensors the caller kept of it.

Inside ``GatheredParameters`` on a CPU device, ``param.detach().cpu()`` is the parameter's own
storage (``.cpu()`` of a CPU tensor returns it unchanged). Releasing the parameter must give it
a fresh storage instead of shrinking the one the caller holds, so the kept values survive the
block; the parameters are released again and train on as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.flat_shard import FlatShard
from shardspeed.runtime.zero.residency import FileResidency
from shardspeed.runtime.zero.state_swap import SwapStore
from shardspeed.zero import GatheredParameters
from tests.runtime.parity import MLP
from tests.runtime.zero.ranks import _engine

SHARD_ALL = {"stage3_param_persistence_threshold": 0}


def _released(param: torch.Tensor) -> bool:
    return param.untyped_storage().nbytes() == 0


def _train_step(engine, step: int) -> float:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    loss = engine(torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen))
    engine.backward(loss)
    engine.step()
    return float(loss)


def kept_values_survive_release() -> None:
    torch.manual_seed(0)
    engine = _engine(MLP(width=8), 3, zero=SHARD_ALL)
    params = list(engine.module.parameters())
    assert all(_released(p) for p in params)
    # read only: what the caller kept outlives the block, the parameters are released
    with GatheredParameters(params):
        kept = [p.detach().cpu() for p in params]
        assert kept[0].untyped_storage().data_ptr() == params[0].untyped_storage().data_ptr()
        expected = [k.clone() for k in kept]
    assert all(_released(p) for p in params)
    for value, want in zip(kept, expected, strict=True):
        assert value.untyped_storage().nbytes() > 0, "the kept tensor lost its memory"
        assert torch.equal(value, want)
    # a modifier rank's edit reaches every rank; the kept alias keeps the edited values too
    first = params[0]
    with GatheredParameters([first], modifier_rank=0):
        if dist.get_rank() == 0:
            first.data.fill_(0.25)
        edited = first.detach().cpu()
    assert torch.equal(edited, torch.full_like(edited, 0.25))
    with GatheredParameters([first]):
        assert torch.equal(first.detach(), torch.full_like(edited, 0.25))
    # a forward inside the block leaves the block's parameters gathered
    with GatheredParameters(params):
        with torch.no_grad():
            engine(torch.randn(2, 8), torch.randn(2, 1))
        assert not any(_released(p) for p in params)
        kept = [p.detach().clone() for p in params]
    assert all(_released(p) for p in params)
    # gathered again by the forward hooks after the fresh storage: training goes on
    losses = [_train_step(engine, step) for step in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(_released(p) for p in params)
    with GatheredParameters([first]):
        assert not torch.equal(first.detach(), torch.full_like(edited, 0.25))  # stepped
    assert torch.equal(edited, torch.full_like(edited, 0.25))
    engine.destroy()


@pytest.mark.timeout(180)
def test_kept_values_survive_release(dist_pool):
    dist_pool(2).run(kept_values_survive_release)


def test_one_rank_nvme_release_keeps_what_the_caller_holds(tmp_path: Path) -> None:
    """With one rank the shard is the full buffer, swapped to a file when released: the
    caller's alias keeps its values, the parameters come back whole."""
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(4))]
    values = [p.detach().clone() for p in params]
    flat = FlatShard(params, [0, 6], 10, CommGroup.single())
    store = SwapStore(tmp_path, 0)
    flat.offload(FileResidency(store, "unit0"))
    flat.release()
    assert _released(params[0])
    flat.gather()
    kept = params[0].detach()
    flat.release()
    assert _released(params[0]) and torch.equal(kept, values[0])
    flat.gather()
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, values, strict=True))
    store.close()
