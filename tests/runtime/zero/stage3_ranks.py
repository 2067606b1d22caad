"""Rank-side code for the ZeRO stage 3 behaviour tests (run on every rank of a ``dist_pool``)."""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.gpt_model import GPT, GPTConfig
from shardspeed import zero
from shardspeed.runtime.zero.partition_parameters import param_status
from shardspeed.zero import GatheredParameters, ZeroParamStatus
from tests.runtime.parity import make_task, rank_rows
from tests.runtime.zero.ranks import _engine

SHARD_ALL = {"param_persistence_threshold": 0}
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


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


def _peak_rss_reset() -> int:
    """Reset this process's peak resident set (Linux) and return the current one, in bytes.

    glibc raises its mmap threshold each time a large block is freed, after which blocks of
    that size come from the heap and stay resident when freed: what this rank did before
    would then decide the peak. A fixed threshold keeps large buffers mapped, so freeing
    returns them and the peak measures this build."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def init_builds_partitioned() -> dict[str, float]:
    """Under ``zero.Init`` the model is born partitioned: no full storage, 1/N held, peak
    resident memory near the share; ``GatheredParameters(modifier_rank=0)`` edits reach every
    rank before any engine exists."""
    world = dist.get_world_size()
    cfg = GPTConfig(vocab_size=512, block_size=16, n_layer=16, n_head=4, n_embd=384)
    torch.manual_seed(0)
    with zero.Init():  # warm-up: the code pages a first build touches count as resident too
        GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32))
    before = _peak_rss_reset()
    with zero.Init():
        model = GPT(cfg)
    peak = _status_kib("VmHWM") * 1024 - before
    params = list(model.parameters())
    full_bytes = sum(p.numel() for p in params) * 4
    assert all(_released(p) for p in params)
    assert all(hasattr(p, "ds_id") for p in params)
    assert {p.ds_status for p in params} == {ZeroParamStatus.NOT_AVAILABLE}
    held = sum(p.ds_tensor.numel() for p in params) * 4
    assert full_bytes / world <= held <= full_bytes / world + 4 * world * len(params)
    weight = model.blocks[3].mlp[0].weight
    assert weight.ds_shape == (4 * cfg.n_embd, cfg.n_embd) and weight.ds_numel == weight.numel()
    with zero.GatheredParameters(weight, modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data.fill_(0.25)
    with zero.GatheredParameters(weight):
        assert torch.all(weight == 0.25)
    return {"peak": float(peak), "full": float(full_bytes), "held": float(held)}


def init_trains_like_a_normal_build() -> None:
    """A model built under ``zero.Init`` has the weights of a normal build and trains the same."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    torch.manual_seed(1)
    with zero.Init():
        partitioned = task.build()
    torch.manual_seed(1)
    normal = task.build()
    engines = [_engine(m, 3, zero=SHARD_ALL) for m in (partitioned, normal)]
    x, y = task.data
    for step in range(3):
        rows = rank_rows(step, 0, 2, 1)
        losses = []
        for engine in engines:
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    with zero.GatheredParameters([*partitioned.parameters(), *normal.parameters()]):
        for p, q in zip(partitioned.parameters(), normal.parameters(), strict=True):
            assert torch.equal(p, q)
    for engine in engines:
        engine.destroy()
    assert not any(hasattr(p, "ds_id") for p in partitioned.parameters())
