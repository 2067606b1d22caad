"""``engine.offload_states`` / ``reload_states``: move training state off the device between
steps (e.g. while the same GPU generates with another model), and back.

Only tensors that stand alone move, by swapping their ``.data`` (identity kept, so the
optimizer's state and the strategy's records still point at them): the optimizer state, fp32
master copies, stage 3's parameter shards and the reduced gradient chunks. The gradient bucket
buffers kept for reuse are freed (they are made again when needed). Stages 0-2 keep the model's
parameters as views of flat buffers the model computes with: moving those is refused with the
kinds that can be moved.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

if TYPE_CHECKING:
    from shardspeed.runtime.zero.strategy import ZeroStrategy

__all__ = ["StateOffloader", "get_state_devices"]


def _state_tensors(strategy: ZeroStrategy, kind: OffloadStateTypeEnum) -> Iterator[torch.Tensor]:
    """The tensors of ``kind`` that ``strategy`` holds (standalone ones only)."""
    optimizer = strategy.optimizer
    if kind == OffloadStateTypeEnum.optim_states:
        if optimizer is not None:
            for state in optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    elif kind == OffloadStateTypeEnum.hp_params:
        for group in strategy.groups:
            if not group.masters.is_identity:
                models = {id(t) for t in group.masters.model_params}
                yield from (m for m in group.masters.master_params if id(m) not in models)
    elif kind == OffloadStateTypeEnum.lp_params:
        sharding = getattr(strategy, "sharding", None)
        if sharding is None:
            raise NotImplementedError(
                f"offload_states: lp_params at ZeRO stage {strategy.stage} are views of the "
                "flat buffers the model computes with and cannot move on their own; offload "
                "optim_states, hp_params or lp_grads, or use ZeRO stage 3"
            )
        for unit in sharding.units:
            if not unit.persistent:
                yield from (flat.shard for flat in unit.flats if flat.comm.partitioned)
    elif kind == OffloadStateTypeEnum.lp_grads:
        for group in strategy.groups:
            yield from (g for g in getattr(group, "grad_chunks", []) if g is not None)


def get_state_devices(model: Any, state: OffloadStateTypeEnum) -> set[torch.device]:
    """The devices holding ``state`` of ``model`` (an engine, or a module an engine trains)."""
    strategy = _strategy_of(model)
    if state == OffloadStateTypeEnum.contiguous_grad_buffer:
        return {
            b.buffer.device
            for group in strategy.groups
            for b in group.buckets.buckets
            if b.buffer is not None
        } or {strategy.placement.device}
    return {t.device for t in _state_tensors(strategy, state)}


def _strategy_of(model: Any) -> ZeroStrategy:
    from shardspeed.runtime.zero.strategy import strategy_of

    strategy = getattr(model, "strategy", None)
    if strategy is None and isinstance(model, nn.Module):
        strategy = next((strategy_of(p) for p in model.parameters() if strategy_of(p)), None)
    if strategy is None:
        raise ValueError("get_state_devices: pass a shardspeed engine, or a module it trains")
    return strategy


class StateOffloader:
    """Moves a strategy's state to the host and back, remembering where each tensor was."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self.strategy = strategy
        self._moved: list[tuple[torch.Tensor, torch.device]] = []

    def offload(
        self,
        include: Container[OffloadStateTypeEnum] | None = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        if OffloadDeviceEnum(device) != OffloadDeviceEnum.cpu:
            raise ValueError(
                f"offload_states(device={device!r}): only 'cpu' is supported, as in DeepSpeed"
            )
        host = torch.device("cpu")
        pin = pin_memory and torch.cuda.is_available()
        for kind in OffloadStateTypeEnum:
            if include is not None and kind not in include and kind.value not in include:
                continue
            if kind == OffloadStateTypeEnum.contiguous_grad_buffer:
                for group in self.strategy.groups:
                    group.buckets.drop_spares()
                continue
            for tensor in _state_tensors(self.strategy, kind):
                if tensor.device == host or tensor.untyped_storage().nbytes() == 0:
                    continue
                self._moved.append((tensor, tensor.device))
                moved = tensor.data.to(host, non_blocking=non_blocking)
                tensor.data = moved.pin_memory() if pin else moved

    def reload(self, non_blocking: bool = False) -> None:
        for tensor, device in self._moved:
            tensor.data = tensor.data.to(device, non_blocking=non_blocking)
        self._moved = []
