"""The tensor-parallel layers AutoTP puts in place of a model's own.

Column-parallel projections need no layer of their own: they are plain linears holding this
rank's output rows. The layers here are the ones that talk to the group: the row-parallel
output projection (one all-reduce per use, bias added once after it), the vocabulary-split
embedding (masked lookup, all-reduce) and the vocabulary-split output head (all-gather).
Each wraps an inner module that does the local math, so quantization can swap that inner module
without knowing about tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.inference.tp_group import TPGroup

__all__ = ["RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead"]


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input features are split across ranks."""

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None, tp: TPGroup) -> None:
        super().__init__()
        self.linear = linear
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias
        self.tp = tp

    @property
    def weight(self) -> torch.Tensor:
        """The local weight (for code that reads ``.weight``, e.g. dtype checks)."""
        return _tensor(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tp.all_reduce_(self.linear(x))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"tp_size={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows ``[start, stop)`` live on this rank; lookups of other rows give
    zeros locally and the all-reduce fills them in."""

    def __init__(self, table: nn.Module, start: int, stop: int, tp: TPGroup) -> None:
        super().__init__()
        self.table = table
        self.start, self.stop = start, stop
        self.tp = tp

    @property
    def weight(self) -> torch.Tensor:
        return _tensor(self.table.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        out: torch.Tensor = self.table(local)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_(out)

    def extra_repr(self) -> str:
        return f"rows=[{self.start}, {self.stop}), tp_size={self.tp.size}"


class VocabParallelHead(nn.Module):
    """The output head with this rank's vocabulary rows; logits are all-gathered to full width."""

    def __init__(self, linear: nn.Module, tp: TPGroup, sizes: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.linear = linear
        self.tp = tp
        self.sizes = sizes  # rows per rank; uneven splits are padded for the all-gather

    @property
    def weight(self) -> torch.Tensor:
        return _tensor(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local: torch.Tensor = self.linear(x)
        if len(set(self.sizes)) <= 1:
            return self.tp.gather_last_dim(local)
        widest = max(self.sizes)
        padded = torch.nn.functional.pad(local, (0, widest - local.shape[-1]))
        parts = self.tp.gather_last_dim(padded).split(widest, dim=-1)
        return torch.cat(
            [part[..., :size] for part, size in zip(parts, self.sizes, strict=True)], -1
        )

    def extra_repr(self) -> str:
        return f"tp_size={self.tp.size}"


def _tensor(value: object) -> torch.Tensor:
    assert isinstance(value, torch.Tensor), "inner module without a weight tensor"
    return value
