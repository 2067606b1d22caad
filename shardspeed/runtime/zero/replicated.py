"""ZeRO stage 0: plain data parallelism, one :class:`~.replicated_group.ReplicatedGroup`.

Every rank holds the full model, gradients and optimizer state; gradients are averaged with a
bucketed all-reduce overlapped with backward, once per accumulation window. Its checkpoint keeps
the optimizer state whole in the model-states file, with a layout in which every stepped tensor
is a bucket of its own, so it re-partitions to and from stages 1 and 2
(:mod:`shardspeed.checkpoint.reshard`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.checkpoint.layout import BucketLayout, replicated_layout
from shardspeed.checkpoint.reshard import Resharder, replicated_from_shard
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.records import ParamRecord
from shardspeed.runtime.zero.replicated_group import ReplicatedGroup
from shardspeed.runtime.zero.shard_group import ShardGroup
from shardspeed.runtime.zero.strategy import ZeroStrategy


class ReplicatedStrategy(ZeroStrategy):
    """Stage 0: replicate everything, all-reduce gradients bucket by bucket."""

    stage = 0
    supports_local_gradients = True

    def make_group(self, records: list[ParamRecord], comm_group: CommGroup) -> ShardGroup:
        return ReplicatedGroup(records, comm_group, self.placement, self.group_options())

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.ctx.precision.uses_master_weights and len(optimizer.state) > 0:
            raise ValueError(
                f"{type(optimizer).__name__} already has state for {len(optimizer.state)} "
                "parameter(s); master weights must be bound before the first optimizer step, "
                "so pass an optimizer that has not stepped yet"
            )

    def keep_in_optimizer(self, tensor: torch.Tensor, stepped: set[int], index: int) -> bool:
        if not self.ctx.precision.uses_master_weights:
            return True  # the optimizer steps the module's parameters: leave its groups be
        if not tensor.requires_grad:
            return False  # a frozen parameter: nothing to step (as DeepSpeed skips it)
        raise ValueError(
            f"optimizer param_groups[{index}] holds a tensor of shape {tuple(tensor.shape)} "
            "that is not one of the model's parameters; build the optimizer on the model's "
            "parameters"
        )

    def _group(self) -> ReplicatedGroup:
        group = self.dense_group()
        assert isinstance(group, ReplicatedGroup)
        return group

    def bucket_layout(self) -> list[BucketLayout]:
        """Each stepped tensor as a bucket of its own, named after its model parameter: what
        re-partitioning to and from stages 1/2 works with."""
        assert self.optimizer is not None
        group = self._group()
        named = {
            id(m): r.name for r, m in zip(group.records, group.masters.master_params, strict=True)
        }
        return replicated_layout(self.optimizer.param_groups, lambda t: named.get(id(t)))

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "layout": self.bucket_layout(),
            **self._group().state_dict(),
        }

    def sharded_state(
        self,
        load_shard: Callable[[int], dict[str, Any]],
        count: int,
        module_state: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """Gather a checkpoint's shards (of any stage, world size or source) into this
        replicated optimizer's state."""
        assert self.optimizer is not None
        layout = self.bucket_layout()
        resharder = Resharder(load_shard, count, module_state)
        state = resharder.state_for(layout, 1, 0, self.optimizer.param_groups)
        shapes, indices, index = {}, [], 0
        for group in self.optimizer.param_groups:
            indices.append(list(range(index, index + len(group["params"]))))
            for tensor in group["params"]:
                shapes[index] = tensor.shape
                index += 1
        optimizer, masters = replicated_from_shard(state, layout, shapes, indices)
        by_name = {b["params"][0][0]: m for b, m in zip(layout, masters, strict=True)}
        strategy: dict[str, Any] = {**super().state_dict(), "layout": layout}
        if not self._group().masters.is_identity:
            strategy["fp32_masters"] = [by_name[name] for name in self._group().master_names()]
        return {"optimizer": optimizer, "loss_scaler": state["loss_scaler"], "strategy": strategy}
