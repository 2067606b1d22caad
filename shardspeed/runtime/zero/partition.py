"""Flat partition arithmetic shared by ZeRO stages 1 and 2.

Gradient buckets (:mod:`~shardspeed.runtime.zero.buckets`) lay their parameters out flat and pad
each bucket to a multiple of the data-parallel world size ``N``; bucket ``b`` of padded size
``S_b`` is split into ``N`` equal chunks of ``S_b / N`` elements and rank ``r`` owns chunk ``r``,
exactly what ``reduce_scatter_tensor`` of the bucket hands it and what ``all_gather_into_tensor``
of the chunks rebuilds. The parameters themselves live in the same layout
(:mod:`~shardspeed.runtime.zero.flat_params`), so a rank's chunk of a bucket is a contiguous
slice of the model's weights as well as of the gradients. With the default bucket size (larger
than most models) a parameter group is one bucket.

This module only does index arithmetic: which elements of which parameter land where in this
rank's chunks (each parameter's :class:`Piece`, kept on its record). It holds no tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardspeed.runtime.zero.buckets import GradBucket
from shardspeed.runtime.zero.records import ParamRecord


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_start, param_stop)`` of ``param.view(-1)`` sit at
    ``[chunk_start, chunk_start + stop - start)`` of this rank's chunk of bucket ``bucket``."""

    bucket: int
    param_start: int
    param_stop: int
    chunk_start: int

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start

    @property
    def chunk_slice(self) -> slice:
        return slice(self.chunk_start, self.chunk_start + self.numel)

    @property
    def param_slice(self) -> slice:
        return slice(self.param_start, self.param_stop)


class FlatPartition:
    """This rank's chunk of every bucket; each record gets the piece of it this rank owns."""

    def __init__(
        self, buckets: Sequence[GradBucket], records: Sequence[ParamRecord], world: int, rank: int
    ) -> None:
        self.world_size = world
        self.rank = rank
        #: elements of this rank's chunk of each bucket (the same on every rank)
        self.chunk_numel: list[int] = []
        for bucket in buckets:
            assert bucket.size % world == 0, "buckets must be padded to the world size"
            self.chunk_numel.append(bucket.size // world)
        for record in records:
            assert record.bucket is not None
            chunk = self.chunk_numel[record.bucket.index]
            lo, hi = chunk * rank, chunk * (rank + 1)
            start, stop = max(record.offset, lo), min(record.offset + record.numel, hi)
            record.piece = (
                Piece(record.bucket.index, start - record.offset, stop - record.offset, start - lo)
                if start < stop
                else None
            )

    def chunk_slice(self, bucket: int) -> slice:
        """Where this rank's chunk sits in bucket ``bucket``'s flat layout."""
        chunk = self.chunk_numel[bucket]
        return slice(chunk * self.rank, chunk * (self.rank + 1))
