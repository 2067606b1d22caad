"""Rank-side code for the ZeRO-3 per-step overhead tests: what the hooks do per step, counted."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardspeed import comm
from tests.runtime.zero.ranks import _engine

SHARD_ALL = {"param_persistence_threshold": 0}


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(32, 1))


def _brute_live(sharding: Any) -> int:
    """The gathered non-persistent elements, summed over every unit from its buffers."""
    return sum(
        unit.numel
        for unit in sharding.units
        if all(flat.gathered for flat in unit.flats) and not unit.persistent
    )


def step_overhead(steps: int = 3) -> dict[str, Any]:
    """Train ``steps`` steps at stage 3 and report what the step cost in collectives and hooks,
    and whether the running live-element count matched the buffers at every module call."""
    engine = _engine(_model(), 3, zero=SHARD_ALL)
    sharding = engine.strategy.sharding
    mismatches: list[tuple[int, int]] = []

    def check(module: nn.Module, *args: Any) -> None:
        del module, args
        live = sharding.live_numel()
        if live != _brute_live(sharding):
            mismatches.append((live, _brute_live(sharding)))

    handles = []
    for module in engine.module.modules():
        handles.append(module.register_forward_pre_hook(check))
        handles.append(module.register_forward_hook(check))
    x, y = torch.randn(4, 32), torch.randn(4, 1)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))  # the traces are recorded
    engine.step()
    comm.reset_comm_volume()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    volume = comm.get_comm_volume()
    for handle in handles:
        handle.remove()
    hooks = [
        len(p._post_accumulate_grad_hooks or {})  # type: ignore[attr-defined]
        for p in engine.module.parameters()
    ]
    result = {
        "world": dist.get_world_size(),
        "ops": {op: v["count"] for op, v in volume.items()},
        "grad_hooks": hooks,
        "moves": getattr(sharding, "moves", None),
        "mismatches": mismatches,
        "live_after": (sharding.live_numel(), _brute_live(sharding)),
        "losses": losses,
    }
    engine.destroy()
    return result
