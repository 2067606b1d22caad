"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned across ranks.

The strategy is stage 2's (:class:`~.partitioned.PartitionedStrategy` with
:class:`~.partitioned_group.ChunkBuffers`) plus a :class:`~.param_sharding.ParamSharding` that
keeps every parameter, trained or frozen, as this rank's shard and gathers it around its use.
Its shard groups are :class:`~.sharded_group.ShardedParamsGroup` objects, one per process
group the parameters reduce over (Mixture of Experts: the expert parameters over their
expert-data-parallel group, sharded over it too). The module's full state dict is gathered unit
by unit; checkpoints keep stages 1-2's bucket layout, so they re-partition to
any stage and world size.

Communication per optimizer step without accumulation: an all-gather of every non-persistent
parameter in forward and again in backward, and one reduce-scatter of the gradients: the
``3Ψ(N-1)/N`` of DeepSpeed's ZeRO-3. With accumulation, gradients accumulate locally (full size,
as stage 2) and are reduce-scattered once per optimizer step. The parameters do not change
between micro-steps, so when the whole model's gathered parameters fit within both
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` they stay gathered from the
first micro-step's backward to the last one's: still ``3Ψ(N-1)/N`` per optimizer step. A model
that does not fit (or ``stage3_max_reuse_distance: 0``) is gathered again in every micro-step's
forward and backward, as DeepSpeed does, ``(2·gas+1)Ψ(N-1)/N``, and memory stays at the shards
plus the units in use.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.param_sharding import ParamSharding
from shardspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from shardspeed.runtime.zero.partitioned import PartitionedStrategy
from shardspeed.runtime.zero.partitioned_group import ChunkBuffers
from shardspeed.runtime.zero.records import ParamRecord
from shardspeed.runtime.zero.shard_group import ShardGroup
from shardspeed.runtime.zero.sharded_group import ShardedParamsGroup
from shardspeed.runtime.zero.strategy import StrategyContext
from shardspeed.utils.leaf_modules import (
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
)
from shardspeed.utils.logging import log_dist


def mark_configured_leaves(module: nn.Module, leaf: Any) -> None:
    """Apply ``zero_optimization.leaf_module`` (classes absent from the model are fine: the
    defaults name Hugging Face MoE blocks; names and suffixes must match something)."""
    if leaf is None:
        return
    set_z3_leaf_modules(module, list(leaf.classes), raise_if_not_found=False)
    if leaf.names:
        set_z3_leaf_modules_by_name(module, list(leaf.names))
    if leaf.name_suffixes:
        set_z3_leaf_modules_by_suffix(module, list(leaf.name_suffixes))


def _host_copies(state: dict[str, Any], copies: dict[int, torch.Tensor]) -> dict[str, Any]:
    """``state`` with its tensors replaced by host copies (``copies`` by tensor id first),
    one copy per tensor: the gathered buffers are released after the caller's gather."""
    result: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            found = copies.get(id(value))
            if found is None:
                found = copies.setdefault(id(value), value.detach().to("cpu", copy=True))
            value = found
        result[key] = value
    return result


class ParamPartitionStrategy(PartitionedStrategy):
    """Stage 3: partitioned parameters, gradients and optimizer state."""

    stage = 3
    gradient_mode = ChunkBuffers

    def __init__(self, module: nn.Module, ctx: StrategyContext) -> None:
        super().__init__(module, ctx)
        mark_configured_leaves(module, ctx.options.leaf_modules)
        self.sharding = ParamSharding(
            module,
            self.registry,
            ctx.default_comm,
            ctx.options.sharding,
            source=ctx.data_parallel,
            comm_of=self.comm_group_of,
        )
        #: DeepSpeed's ``optimizer.parameter_offload``: the module hooks, for clients that take
        #: them off around a whole-model forward (not to be confused with ``param_offload``,
        #: the ``offload_param`` placement)
        self.parameter_offload = DeepSpeedZeRoOffload(self.sharding)

    @torch.no_grad()
    def place_module(self, move: bool = True) -> None:
        """Cast and move the buffers as the other stages do, then hand every parameter to the
        sharding unit by unit (never the whole module at once: it may have been built
        partitioned by ``zero.Init`` because it does not fit). Every rank starts from the
        data-parallel group's first rank's weights; expert parameters from their
        expert-data-parallel group's first rank (the other ranks hold other experts)."""
        dtype = self.ctx.precision.param_dtype
        device = self.placement.device if move else None
        dp = self.ctx.data_parallel
        for module in self.module.modules():
            for key, buffer in module._buffers.items():
                if buffer is None:
                    continue
                cast = dtype if buffer.is_floating_point() else buffer.dtype
                placed = buffer.to(device=device or buffer.device, dtype=cast)
                dp.broadcast(placed)
                module._buffers[key] = placed
        if self.param_offload.enabled:  # each unit goes out as soon as it is sharded
            host = torch.device("cpu") if self.param_offload.device == "cpu" else None
            store = self.swap_store() if self.param_offload.to_nvme else None
            self.sharding.offload_to(host, store)
        self.sharding.shard(dtype if dtype != torch.float32 else None, device, broadcast=True)

    def make_group(self, records: list[ParamRecord], comm_group: CommGroup) -> ShardGroup:
        return ShardedParamsGroup(
            records,
            comm_group,
            self.placement,
            self.group_options(),
            mode=self.gradient_mode(),
            sharding=self.sharding,
        )

    # -- the module ------------------------------------------------------------------------
    def full_state_dict(
        self, prefix: str = "", keep_vars: bool = False, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """The whole module's state dict, its parameters copied to host memory one gather unit
        at a time, so the device never holds more than the units in use plus one (a module
        whose state-dict hooks may read parameters is gathered whole instead). Tied weights
        stay one tensor under both names."""
        if any(m._state_dict_hooks or m._state_dict_pre_hooks for m in self.module.modules()):
            with self.sharding.gathered():
                state = super().full_state_dict(prefix, keep_vars, exclude_frozen_parameters)
                return _host_copies(state, {})
        state = super().full_state_dict(prefix, True, exclude_frozen_parameters)
        wanted = {id(v) for v in state.values() if isinstance(v, nn.Parameter)}
        copies: dict[int, torch.Tensor] = {}
        for unit in self.sharding.units:
            params = [r.param for r in unit.records if id(r.param) in wanted]
            if not params:
                continue
            with self.sharding.gathered([unit]):
                for param in params:
                    copies[id(param)] = param.detach().to("cpu", copy=True)
        return _host_copies(state, copies)

    def weights_for_save(
        self, exclude_frozen_parameters: bool = False, gather_partitioned: bool = False
    ) -> dict[str, Any] | None:
        if not gather_partitioned:
            log_dist(
                "save_16bit_model: not saved, because ZeRO stage 3 keeps the weights partitioned "
                "and zero_optimization.stage3_gather_16bit_weights_on_model_save is false; set "
                "it to true to gather them at save time, or save a checkpoint and consolidate it "
                "with zero_to_fp32 (shardspeed-zero-to-fp32)",
                [0],
                level=logging.WARNING,
            )
            return None
        return super().weights_for_save(exclude_frozen_parameters)

    def load_full_state_dict(
        self, state: dict[str, Any], strict: bool = True, custom_load_fn: Any = None
    ) -> None:
        with self.sharding.gathered():
            super().load_full_state_dict(state, strict, custom_load_fn)
            self.sharding.keep_full_values()

    def empty_partition_cache(self) -> None:
        self.sharding.empty_cache()

    # -- backward --------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        self.sharding.begin_backward(reduce)
        super().begin_backward(reduce)

    def end_backward(self) -> None:
        super().end_backward()
        self.sharding.end_backward()

    def destroy(self) -> None:
        self.sharding.remove_hooks()
        super().destroy()
