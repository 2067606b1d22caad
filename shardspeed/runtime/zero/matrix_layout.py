"""The matrix layouts a partitioned shard group (ZeRO stages 1-3) hands an optimizer that needs
each matrix whole (Muon, :mod:`shardspeed.ops.muon`).

Every bucket's flat buffer holds whole parameters at known offsets and each rank steps one equal
chunk of it; the layout names the parameters' (offset, shape) and gives the two collectives over
the group that move whole-buffer data: an all-gather of every rank's chunk and a reduce-scatter
(plain sums: neither ZeRO++'s quantization nor MiCS's replica all-reduce belongs in them, since
every replica holds the same values). Tensors kept off the device (ZeRO-Offload) travel through
the device, which every backend's collectives accept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardspeed import comm
from shardspeed.ops.muon.layout import MatrixSpan, ShardedMatrices
from shardspeed.runtime.zero.records import ParamRecord

if TYPE_CHECKING:
    from shardspeed.runtime.zero.partitioned_group import PartitionedGroup


class GroupCollectives:
    """Whole-buffer all-gather and reduce-scatter over one shard group's ranks."""

    def __init__(self, group: PartitionedGroup) -> None:
        self.comm = group.comm
        self.device = group.placement.device

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        if not self.comm.partitioned:
            return chunk
        out = torch.empty(
            chunk.numel() * self.comm.world_size, dtype=chunk.dtype, device=self.device
        )
        comm.all_gather_into_tensor(out, chunk.to(self.device), group=self.comm.group)
        return out

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        if not self.comm.partitioned:
            return full
        out = torch.empty(
            full.numel() // self.comm.world_size, dtype=full.dtype, device=self.device
        )
        comm.reduce_scatter_tensor(out, full.to(self.device), group=self.comm.group)
        return out


def partitioned_matrix_layouts(group: PartitionedGroup) -> dict[int, ShardedMatrices]:
    """Each stepped chunk's layout, by the chunk's id."""
    by_bucket: dict[int, list[ParamRecord]] = {}
    for record in group.buckets.records:
        assert record.bucket is not None
        by_bucket.setdefault(record.bucket.index, []).append(record)
    collectives = GroupCollectives(group)
    layouts: dict[int, ShardedMatrices] = {}
    for bucket, master in zip(group.buckets.buckets, group.master_chunks, strict=True):
        records = sorted(by_bucket.get(bucket.index, []), key=lambda r: r.offset)
        layouts[id(master)] = ShardedMatrices(
            matrices=tuple(MatrixSpan(r.offset, r.param.shape) for r in records),
            rank=group.comm.rank,
            world_size=group.comm.world_size,
            chunk_numel=group.partition.chunk_numel[bucket.index],
            gather=collectives.gather,
            reduce_scatter=collectives.reduce_scatter,
        )
    return layouts
