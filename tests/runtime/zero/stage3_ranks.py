"""Rank-side code for the ZeRO stage 3 behaviour tests (run on every rank of a ``dist_pool``)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.runtime.zero.partition_parameters import param_status
from shardspeed.zero import GatheredParameters, ZeroParamStatus
from tests.runtime.parity import make_task, rank_rows
from tests.runtime.zero.ranks import _engine

SHARD_ALL = {"param_persistence_threshold": 0}


def _released(param: nn.Parameter) -> bool:
    return param.untyped_storage().nbytes() == 0


def shards_between_uses() -> None:
    """Between uses every parameter holds no full storage and reports NOT_AVAILABLE; a module's
    parameters are AVAILABLE inside its forward; this rank keeps 1/N of the (padded) model."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * world)
    model = task.build()
    total = sum(p.numel() for p in model.parameters())
    engine = _engine(model, 3, zero=SHARD_ALL)
    params = list(model.parameters())
    assert all(_released(p) for p in params)
    assert {param_status(p) for p in params} == {ZeroParamStatus.NOT_AVAILABLE}
    held = sum(flat.shard.numel() for unit in engine.strategy.sharding.units for flat in unit.flats)
    assert total / world <= held <= total / world + len(engine.strategy.sharding.units) * world
    seen: dict[str, ZeroParamStatus] = {}
    qkv = model.blocks[1].attn.qkv

    def probe(module: nn.Module, args: Any) -> None:
        seen["qkv"] = param_status(module.weight)
        seen["other block"] = param_status(model.blocks[0].mlp[0].weight)

    handle = qkv.register_forward_pre_hook(probe)  # runs after the engine's own pre-hook
    x, y = task.data
    rows = rank_rows(0, 0, 2, 1)
    loss = engine(x[rows], y[rows])
    assert seen == {
        "qkv": ZeroParamStatus.AVAILABLE,
        "other block": ZeroParamStatus.NOT_AVAILABLE,
    }
    assert all(_released(p) for p in params)  # forward done: all released again
    engine.backward(loss)
    engine.step()
    assert all(_released(p) for p in params)
    handle.remove()
    engine.destroy()


def eval_state_dict_and_gathered_edits() -> None:
    """``no_grad`` evaluation gives the stage 0 outputs; the full state dict equals the
    gathered weights; ``GatheredParameters(modifier_rank=0)`` edits reach every rank's
    shards (and the optimizer, which steps them), read-only gathers discard edits."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    base = task.build()
    engines = [_engine(copy.deepcopy(base), stage, zero=SHARD_ALL) for stage in (0, 3)]
    x, y = task.data
    for step in range(2):
        rows = rank_rows(step, 0, 2, 1)
        for engine in engines:
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
    reference, sharded = engines
    for engine in engines:
        engine.eval()
    with torch.no_grad():
        expected = reference.module(x[:4])
        actual = sharded.module(x[:4])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    model = sharded.module
    assert all(_released(p) for p in model.parameters())
    state = sharded.module_state_dict()
    ref_state = reference.module_state_dict()
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)

    weight = model.blocks[0].mlp[0].weight
    with GatheredParameters(weight):
        assert param_status(weight) == ZeroParamStatus.AVAILABLE
        original = weight.detach().clone()
        weight.data.fill_(7.0)  # read-only: thrown away on exit
    with GatheredParameters([weight]):
        torch.testing.assert_close(weight.detach(), original)
    with GatheredParameters(weight, modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data.fill_(0.5)
    assert _released(weight)
    with GatheredParameters(weight):
        assert torch.all(weight == 0.5)
    from shardspeed.utils import safe_get_full_fp32_param

    assert torch.all(safe_get_full_fp32_param(weight) == 0.5)  # the optimizer's copy follows
    sharded.train()
    rows = rank_rows(2, 0, 2, 1)
    sharded.backward(sharded(x[rows], y[rows]))
    sharded.step()
    for engine in engines:
        engine.destroy()
