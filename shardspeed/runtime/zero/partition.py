"""Flat partition arithmetic shared by ZeRO stages 1 and 2.

Gradient buckets (:mod:`~shardspeed.runtime.zero.buckets`) lay their parameters out flat and pad
each bucket to a multiple of the data-parallel world size ``N``; bucket ``b`` of padded size
``S_b`` is split into ``N`` equal chunks of ``S_b / N`` elements and rank ``r`` owns chunk ``r``,
exactly what ``reduce_scatter_tensor`` of the bucket hands it. A rank's *partition* of a parameter
group is the concatenation, in bucket order, of its chunks of that group's buckets. With the
default bucket size (larger than most models) a group is one bucket, and the partition is simply
the ``r``-th contiguous ``1/N`` of the group's flattened, padded parameters.

This module only does index arithmetic: which elements of which parameter land where in this
rank's partition. It holds no tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from shardspeed.runtime.zero.buckets import GradBucket


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_start, param_stop)`` of ``param.view(-1)`` sit at
    ``[part_start, part_start + stop - start)`` of this rank's partition of group ``group``."""

    group: int
    param_start: int
    param_stop: int
    part_start: int

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start

    @property
    def part_slice(self) -> slice:
        return slice(self.part_start, self.part_start + self.numel)

    @property
    def param_slice(self) -> slice:
        return slice(self.param_start, self.param_stop)


@dataclass(frozen=True)
class ChunkSlot:
    """Where this rank's chunk of one bucket lives in its partition of the bucket's group."""

    group: int
    part_start: int
    numel: int

    @property
    def part_slice(self) -> slice:
        return slice(self.part_start, self.part_start + self.numel)


class FlatPartition:
    """This rank's share of every bucket, grouped by parameter group."""

    def __init__(
        self,
        buckets: Sequence[GradBucket],
        group_of: dict[int, int],
        num_groups: int,
        world_size: int,
        rank: int,
    ) -> None:
        """``group_of`` maps ``id(param)`` to its optimizer parameter-group index; a bucket never
        mixes groups."""
        self.world_size = world_size
        self.rank = rank
        self.group_numel = [0] * num_groups
        self.chunks: list[ChunkSlot] = []
        self._pieces: dict[int, Piece] = {}
        for bucket in buckets:
            assert bucket.size % world_size == 0, "buckets must be padded to the world size"
            group = group_of[id(bucket.params[0])]
            chunk = bucket.size // world_size
            slot = ChunkSlot(group, self.group_numel[group], chunk)
            self.chunks.append(slot)
            self._add_pieces(bucket, slot, chunk * rank, chunk * (rank + 1))
            self.group_numel[group] += chunk

    def _add_pieces(self, bucket: GradBucket, slot: ChunkSlot, lo: int, hi: int) -> None:
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            start, stop = max(offset, lo), min(offset + param.numel(), hi)
            if start < stop:
                self._pieces[id(param)] = Piece(
                    slot.group, start - offset, stop - offset, slot.part_start + start - lo
                )

    def piece(self, param: nn.Parameter) -> Piece | None:
        """This rank's piece of ``param`` (None if this rank owns none of it)."""
        return self._pieces.get(id(param))

    def pieces(self) -> dict[int, Piece]:
        """``id(param)`` -> piece, for every parameter this rank owns part of."""
        return dict(self._pieces)

    @property
    def numel(self) -> int:
        """Elements this rank owns over all groups, padding included."""
        return sum(self.group_numel)


def allgather_batches(buckets: Sequence[GradBucket], batch_size: int) -> list[list[int]]:
    """Indices of consecutive same-dtype buckets gathered by one collective: at most
    ``batch_size`` elements each (a larger bucket travels alone)."""
    batches: list[list[int]] = []
    size = 0
    for index, bucket in enumerate(buckets):
        if batches:
            first = buckets[batches[-1][0]]
            same = first.dtype == bucket.dtype and first.device == bucket.device
            if same and size + bucket.size <= batch_size:
                batches[-1].append(index)
                size += bucket.size
                continue
        batches.append([index])
        size = bucket.size
    return batches
