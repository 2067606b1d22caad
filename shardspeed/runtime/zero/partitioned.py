"""ZeRO stages 1 and 2: one :class:`~.partitioned_group.PartitionedGroup` each, fp32 masters,
optimizer state and reduced gradients partitioned across data-parallel ranks.

The stages differ only in where a rank's reduced gradients live (the group's mode): stage 1
keeps full-size gradient buffers and reduces into its own chunk of them
(:class:`~.partitioned_group.InPlaceChunks`), stage 2 stages gradients into short-lived bucket
buffers and keeps only its partition (:class:`~.partitioned_group.ChunkBuffers`), so ``no_sync``
and accumulation work as in stage 0 while no rank holds a full reduced gradient. Every rank saves
its own shard of the optimizer state with the bucket layout, so the checkpoint re-partitions to
another world size, bucket size or stage (:mod:`shardspeed.checkpoint.reshard`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from shardspeed.checkpoint.files import OPTIM_SHARD
from shardspeed.checkpoint.layout import BucketLayout, layouts_match
from shardspeed.checkpoint.reshard import Resharder
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.partitioned_group import (
    ChunkBuffers,
    InPlaceChunks,
    PartitionedGroup,
    ReducedGradients,
)
from shardspeed.runtime.zero.records import ParamRecord
from shardspeed.runtime.zero.shard_group import ShardGroup
from shardspeed.runtime.zero.strategy import ZeroStrategy
from shardspeed.utils.logging import log_dist

# torch optimizers DeepSpeed lists as ZeRO-supported; every optimizer in shardspeed.ops is too
_TESTED_TORCH_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def check_optimizer_is_tested(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """DeepSpeed's rule: ZeRO with an optimizer outside its tested list needs
    ``"zero_allow_untested_optimizer": true`` (then it only warns)."""
    cls = type(optimizer)
    if cls in _TESTED_TORCH_OPTIMIZERS or cls.__module__.startswith("shardspeed.ops"):
        return
    if not allow_untested:
        raise ValueError(
            f"optimizer {cls.__module__}.{cls.__qualname__} has not been tested with ZeRO "
            "(tested: torch.optim.Adam/AdamW/Adagrad and the shardspeed.ops optimizers); add "
            '"zero_allow_untested_optimizer": true to the config to use it anyway'
        )
    log_dist("**** You are using ZeRO with an untested optimizer, proceed with caution ****", [0])


class PartitionedStrategy(ZeroStrategy):
    """Stages 1 and 2: a partitioned group whose reduced-gradient mode is the stage's."""

    #: the kind of :class:`ReducedGradients` mode the stage's group uses
    gradient_mode: ClassVar[type[ReducedGradients]]

    def make_group(self, records: list[ParamRecord], comm_group: CommGroup) -> ShardGroup:
        return PartitionedGroup(
            records, comm_group, self.placement, self.group_options(), mode=self.gradient_mode()
        )

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        check_optimizer_is_tested(optimizer, self.ctx.allow_untested_optimizer)
        if len(optimizer.state) > 0:
            raise ValueError(
                f"{type(optimizer).__name__} already has state; ZeRO partitions the optimizer "
                "before its first step, so pass an optimizer that has not stepped yet"
            )

    def _group(self) -> PartitionedGroup:
        group = self.dense_group()
        assert isinstance(group, PartitionedGroup)
        return group

    def checkpoint_shard_name(self, dp_rank: int | None = None) -> str | None:
        shards = self.ctx.default_comm
        if dp_rank is None and shards.replicated_over is not None and shards.replicated_over.rank:
            return None  # MiCS: the first shard group's ranks save the (replicated) shards
        return OPTIM_SHARD.format(shards.rank if dp_rank is None else dp_rank)

    def bucket_layout(self) -> list[BucketLayout]:
        """Which parameter (by name) sits where in which bucket: saved with every shard, so the
        checkpoint can be re-partitioned."""
        stepped = self.master_params()
        index = {id(p): i for i, p in enumerate(stepped)}  # torch's state_dict numbering
        return self._group().bucket_layout(index)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "layout": self.bucket_layout(),
            **self._group().state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fp32_chunks") is not None:
            self._group().check_layout(state, self.bucket_layout())
        super().load_state_dict(state)

    def sharded_state(
        self,
        load_shard: Callable[[int], dict[str, Any]],
        count: int,
        module_state: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        # always rebuilt from the shards, also when nothing changed: one path, and the
        # rebuilt tensors own their memory (the shards may be memory-mapped files)
        assert self.optimizer is not None
        layout, dp = self.bucket_layout(), self.ctx.default_comm
        resharder = Resharder(load_shard, count, module_state, reference=min(dp.rank, count - 1))
        if not layouts_match(resharder.reference["strategy"], layout, dp.world_size):
            log_dist(
                f"re-partitioning ZeRO optimizer shards saved by {count} ranks for "
                f"{dp.world_size} ranks and this run's buckets",
                [0],
            )
        state = resharder.state_for(layout, dp.world_size, dp.rank, self.optimizer.param_groups)
        state["strategy"] = {**state["strategy"], **super().state_dict()}
        return state


class OptimizerStateStrategy(PartitionedStrategy):
    """Stage 1: partitioned optimizer state, full gradients, reduce-scatter + all-gather."""

    stage = 1
    gradient_mode = InPlaceChunks


class GradientPartitionStrategy(PartitionedStrategy):
    """Stage 2: partitioned optimizer state and gradients, bucketed reduce-scatter in backward."""

    stage = 2
    gradient_mode = ChunkBuffers
