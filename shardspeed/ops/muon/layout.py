"""How whole matrices sit in a flat buffer whose chunks are spread over ranks.

A ZeRO stage 1-3 optimizer steps one contiguous chunk of a flat buffer per rank, cut without
regard to where one parameter ends and the next begins. Muon needs each matrix whole, so the
strategy that holds the chunks describes them to the optimizer with a :class:`ShardedMatrices`:
the matrices (offset, shape) of the flat buffer, which chunk this rank steps, and the two
collectives that move whole-buffer data between the ranks. This module knows no ZeRO stage and
no process group: the collectives are callables the strategy builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: ``gather(chunk)``: every rank's chunk concatenated in rank order (the whole flat buffer)
Gather = Callable[[torch.Tensor], torch.Tensor]
#: ``reduce_scatter(full)``: the sum over ranks of ``full``, this rank's chunk of it
ReduceScatter = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MatrixSpan:
    """A matrix at elements ``[offset, offset + numel)`` of the flat buffer."""

    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return int(self.shape.numel())

    def overlap(self, start: int, stop: int) -> tuple[int, int] | None:
        """The part of ``[start, stop)`` this matrix covers, or None."""
        lo, hi = max(self.offset, start), min(self.offset + self.numel, stop)
        return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class ShardedMatrices:
    """One stepped tensor that is chunk ``rank`` of ``world_size`` equal chunks of a flat buffer
    holding ``matrices`` (padding after the last is allowed)."""

    matrices: tuple[MatrixSpan, ...]
    rank: int
    world_size: int
    chunk_numel: int
    gather: Gather
    reduce_scatter: ReduceScatter

    @property
    def chunk_start(self) -> int:
        return self.rank * self.chunk_numel

    @property
    def full_numel(self) -> int:
        return self.world_size * self.chunk_numel

    def mine(self) -> list[tuple[MatrixSpan, int, int]]:
        """Each matrix with elements in this rank's chunk, and the range of them (flat)."""
        start, stop = self.chunk_start, self.chunk_start + self.chunk_numel
        return [(m, *span) for m in self.matrices if (span := m.overlap(start, stop))]
