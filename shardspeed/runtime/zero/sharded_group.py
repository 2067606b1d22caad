"""A sharded-parameter shard group (ZeRO stage 3): stage 2's partitioned group whose parameters
also live as shards.

Its gradient buckets follow the gather units (one per unit and optimizer parameter group, laid
out as that unit's :class:`~.flat_shard.FlatShard`), so a bucket's reduce-scatter hands every
rank the gradient of exactly its parameter shard, and the optimizer steps the shard itself (fp32)
or an fp32 copy of it (fp16/bf16). After the step nothing is all-gathered: the next forward
gathers what it uses; only buffers that are gathered at that moment (persistent units) are
refreshed. Reduced gradients, masters, fragments and checkpoint state are the partitioned
group's (:class:`~.partitioned_group.ChunkBuffers` mode), so stage 3 checkpoints have the same
bucket layout as stages 1 and 2 and re-partition across all of them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from shardspeed.runtime.zero.buckets import GradBucket, GradientBuckets
from shardspeed.runtime.zero.flat_shard import FlatShard
from shardspeed.runtime.zero.grad_storage import StagedStorage
from shardspeed.runtime.zero.param_sharding import ParamSharding
from shardspeed.runtime.zero.partition import FlatPartition
from shardspeed.runtime.zero.partitioned_group import PartitionedGroup
from shardspeed.runtime.zero.reduce_options import accumulation_dtype
from shardspeed.runtime.zero.zeropp import step_traffic, traffic_line
from shardspeed.utils.logging import log_dist

# a gather unit is never split by size: its bucket is exactly its flat buffer
_UNBOUNDED = 2**62


class ShardedParamsGroup(PartitionedGroup):
    """Partitioned masters, optimizer state, gradients and parameters."""

    def __init__(self, *args: Any, sharding: ParamSharding, **kwargs: Any) -> None:
        self.sharding = sharding
        super().__init__(*args, **kwargs)

    def build_buckets(self) -> GradientBuckets:
        policy = self.options.precision
        mine = {id(r) for r in self.records}
        # backward order of the units; inside a unit, one run per optimizer parameter group
        ordered = [
            record
            for unit in reversed(self.sharding.units)
            for record in sorted(
                (r for r in unit.records if id(r) in mine), key=lambda r: r.opt_group
            )
        ]
        buckets = GradientBuckets(
            ordered,
            _UNBOUNDED,
            self._launch,
            pad_to=self.comm.world_size,
            split_key=lambda r: (r.unit.index if r.unit else -1, r.opt_group),
            staged=StagedStorage(),
            dtype=accumulation_dtype(policy, self.options.grad_accum_dtype, policy.param_dtype),
        )
        #: each bucket's parameters, kept as this rank's shard
        self.shards: list[FlatShard] = self.sharding.adopt_buckets(buckets.buckets, self.comm)
        self.partition = FlatPartition(
            buckets.buckets, self.records, self.comm.world_size, self.comm.rank
        )
        self.sharding.watch_gradients(self.records)
        self._announce_zeropp(buckets)
        return buckets

    def _announce_zeropp(self, buckets: GradientBuckets) -> None:
        """Log once, on rank 0, the bus bytes per step ZeRO++ saves (theory: one forward, its
        backward and one reduction, from the released buffers' and buckets' sizes)."""
        settings = self.comm.zeropp
        if settings is None or not settings.enabled or not self.comm.partitioned:
            return
        mine = {id(flat) for flat in self.shards}
        gathers = [
            (flat.full.numel(), flat.full.element_size())
            for unit in self.sharding.units
            if not unit.persistent
            for flat in unit.flats
            if id(flat) in mine
        ]
        reductions = [(b.size, (b.comm_dtype or b.dtype).itemsize) for b in buckets.buckets]
        traffic = step_traffic(settings, self.comm.world_size, gathers, reductions)
        log_dist(traffic_line(settings, traffic), ranks=[0], level=logging.INFO)

    def _param_chunk(self, bucket: int) -> torch.Tensor:
        return self.shards[bucket].shard

    @staticmethod
    def _opt_group(bucket: GradBucket) -> int:
        return int(bucket.key[1])  # type: ignore[index]  # split by (unit, opt group)

    @torch.no_grad()
    def after_step(self) -> None:
        """The updated fp32 masters into the shards (cast; a shard swapped to NVMe is read,
        written and swapped out again), then gathered units follow. Every shard changed
        (also one the optimizer steps itself): ZeRO++'s secondary shards are dropped."""
        batched: list[tuple[torch.Tensor, torch.Tensor]] = []
        for flat, master in zip(self.shards, self.master_chunks, strict=True):
            flat.invalidate_secondary()
            if master is flat.shard:
                continue
            if flat.residency.swapped or flat.shard.device != master.device:
                flat.set_shard(master)
            else:  # in memory: no residency step, so one multi-tensor copy does them all
                batched.append((flat.shard, master))
        if batched:
            shards, masters = zip(*batched, strict=True)
            torch._foreach_copy_(list(shards), list(masters))
        if self.comm.partitioned:
            self._gather_params()

    def _gather_params(self) -> None:
        # released buffers are gathered by the next forward; gathered ones must follow now
        works = [w for flat in self.shards if (w := flat.refresh()) is not None]
        for work in works:
            work.wait()
