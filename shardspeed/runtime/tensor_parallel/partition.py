"""Which slice of a full weight a tensor-parallel rank keeps: ranges along one dimension.

Pure arithmetic, no torch.distributed: :class:`Slice` names the ranges, :func:`split_range`
splits a size into near-equal multiples of a grain, :class:`HeadLayout` places attention heads
(including grouped-query attention with fewer key/value heads than ranks, where each rank keeps a
copy of the one key/value head its query heads use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HeadLayout", "Slice", "SplitLayout", "split_range"]


@dataclass(frozen=True)
class Slice:
    """The ranges ``pieces`` (start, stop) along ``dim`` of a full tensor, concatenated."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        """Length of the kept tensor along ``dim``."""
        return sum(stop - start for start, stop in self.pieces)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This slice of ``full`` (a view when it is one range)."""
        parts = [full.narrow(self.dim, start, stop - start) for start, stop in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def on_dim(self, dim: int) -> Slice:
        """The same ranges along another dimension (a transposed layout such as Conv1D)."""
        return Slice(dim, self.pieces)


def split_range(total: int, parts: int, index: int, grain: int = 1) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` is split into ``parts`` near-equal
    pieces, each a multiple of ``grain`` where ``total`` allows (the first parts get the rest)."""
    if grain < 1 or total % grain or total // grain < parts:
        grain = 1
    units = total // grain
    base, extra = divmod(units, parts)
    start = (index * base + min(index, extra)) * grain
    stop = start + (base + (1 if index < extra else 0)) * grain
    return start, stop


@dataclass(frozen=True)
class HeadLayout:
    """Attention heads of one rank: query heads split evenly, key/value heads split evenly or,
    with fewer key/value heads than ranks, the one shared by this rank's query heads."""

    q_heads: int
    kv_heads: int
    head_dim: int
    tp_size: int
    rank: int

    def __post_init__(self) -> None:
        tp = self.tp_size
        if self.q_heads % tp:
            raise ValueError(
                f"tensor_parallel.tp_size={tp} does not divide the model's "
                f"{self.q_heads} attention heads; choose a tp_size that divides {self.q_heads}."
            )
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ValueError(
                f"tensor_parallel.tp_size={tp} and the model's {self.kv_heads} key/value heads "
                "do not fit: tp_size must divide the key/value heads or be a multiple of them."
            )

    @property
    def local_q_heads(self) -> int:
        return self.q_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(self.kv_heads // self.tp_size, 1)

    def q_slice(self, dim: int) -> Slice:
        """Rows (``dim``) of a query projection, or columns of the output projection."""
        first = self.rank * self.local_q_heads
        return self._heads(first, self.local_q_heads, dim)

    def kv_slice(self, dim: int) -> Slice:
        """Rows (``dim``) of a key or value projection."""
        if self.kv_heads >= self.tp_size:
            first = self.rank * self.local_kv_heads
        else:  # replicated: ranks_per_kv consecutive ranks share key/value head rank // that
            first = self.rank // (self.tp_size // self.kv_heads)
        return self._heads(first, self.local_kv_heads, dim)

    def fused_qkv_slice(self, dim: int) -> Slice:
        """Rows of a fused [q | k | v] projection (GPT-2's ``c_attn``)."""
        q_width = self.q_heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        q = self.q_slice(dim).pieces
        k = tuple((q_width + a, q_width + b) for a, b in self.kv_slice(dim).pieces)
        v = tuple(
            (q_width + kv_width + a, q_width + kv_width + b) for a, b in self.kv_slice(dim).pieces
        )
        return Slice(dim, q + k + v)

    def interleaved_qkv_slice(self, dim: int) -> Slice:
        """Rows of a fused projection stored head by head as ``[q_h | k_h | v_h]`` (Falcon with
        ``multi_query=False``): this rank's query heads with their own keys and values."""
        first, count, width = self.rank * self.local_q_heads, self.local_q_heads, 3 * self.head_dim
        return Slice(dim, ((first * width, (first + count) * width),))

    def grouped_qkv_slice(self, dim: int) -> Slice:
        """Rows of a fused projection stored per key/value group as ``[q_1 .. q_g | k | v]``
        (Falcon's ``new_decoder_architecture``): whole groups, or with fewer key/value heads
        than ranks this rank's query heads of its group plus that group's key and value."""
        group = self.q_heads // self.kv_heads
        width = (group + 2) * self.head_dim
        if self.kv_heads >= self.tp_size:
            first = self.rank * self.local_kv_heads
            return Slice(dim, ((first * width, (first + self.local_kv_heads) * width),))
        ranks_per_kv = self.tp_size // self.kv_heads
        base = (self.rank // ranks_per_kv) * width
        q_first = base + (self.rank % ranks_per_kv) * self.local_q_heads * self.head_dim
        q_stop = q_first + self.local_q_heads * self.head_dim
        kv_first = base + group * self.head_dim
        return Slice(dim, ((q_first, q_stop), (kv_first, kv_first + 2 * self.head_dim)))

    def _heads(self, first: int, count: int, dim: int) -> Slice:
        return Slice(dim, ((first * self.head_dim, (first + count) * self.head_dim),))


@dataclass(frozen=True)
class SplitLayout:
    """How one tensor is split over a tensor-parallel group: its whole shape and every rank's
    :class:`Slice` of it, in rank order. Ranks may hold the same slice (key/value heads
    replicated when there are fewer of them than ranks)."""

    full_shape: tuple[int, ...]
    pieces: tuple[Slice, ...]

    @property
    def dim(self) -> int:
        return self.pieces[0].dim

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.pieces[rank].size
        return tuple(shape)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of the whole tensor ``full``."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"a tensor of shape {tuple(full.shape)} where the split layout expects the "
                f"whole shape {self.full_shape}"
            )
        return self.pieces[rank].take(full)

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece (``parts[r]``: rank ``r``'s)."""
        full = parts[0].new_empty(self.full_shape)
        for piece, part in zip(self.pieces, parts, strict=True):
            offset = 0
            for start, stop in piece.pieces:
                full.narrow(self.dim, start, stop - start).copy_(
                    part.narrow(self.dim, offset, stop - start)
                )
                offset += stop - start
        return full

    def replica_sets(self) -> list[list[int]]:
        """Ranks holding the same slice, grouped (one list per distinct slice, in rank
        order); all singletons when every rank holds its own."""
        groups: dict[Slice, list[int]] = {}
        for rank, piece in enumerate(self.pieces):
            groups.setdefault(piece, []).append(rank)
        return list(groups.values())
