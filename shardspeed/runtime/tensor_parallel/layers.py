"""Column- and row-parallel linears for training, cut from a whole ``nn.Linear``.

A column-parallel linear keeps this rank's rows of the weight (output features) and of the
bias; its input is used whole by every rank, its output is this rank's features (or, with
``gather_output``, all of them). A row-parallel linear keeps this rank's columns of the weight
(input features); each rank's product is a partial sum, added over the group, and the bias
(kept whole on every rank) is added once after the sum. The usual pair, column then row, costs
one all-reduce forward (after the row linear) and one backward (into the column linear's input).

Split weights are marked ``tensor_model_parallel = True`` (Megatron's mark, which the gradient
norm reads: each rank's piece counts; unmarked parameters, such as a row-parallel bias, count
on tensor-parallel rank 0 only). Splits are near-equal multiples of ``grain`` (the first ranks
take the rest), so widths need not divide by the group's size.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from shardspeed.runtime.tensor_parallel.collectives import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    split_to_tensor_parallel,
)
from shardspeed.runtime.tensor_parallel.partition import split_range
from shardspeed.runtime.zero.comm_group import CommGroup

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "split_widths"]


def split_widths(total: int, group: CommGroup, grain: int = 1) -> tuple[int, ...]:
    """Every rank's share of ``total`` features, in rank order."""
    if total < group.world_size:
        raise ValueError(
            f"{total} features cannot be split over {group.world_size} tensor-parallel ranks "
            "(each needs at least one); use a smaller tensor-parallel size"
        )
    ranges = [split_range(total, group.world_size, r, grain) for r in range(group.world_size)]
    return tuple(stop - start for start, stop in ranges)


def _mark(param: nn.Parameter, split: bool) -> nn.Parameter:
    param.tensor_model_parallel = split  # type: ignore[attr-defined]
    return param


def _piece(full: torch.Tensor, dim: int, widths: tuple[int, ...], rank: int) -> torch.Tensor:
    start = sum(widths[:rank])
    return full.detach().narrow(dim, start, widths[rank]).clone()


class _SplitLinear(nn.Module):
    """A linear whose weight is split along ``split_dim`` (0: output rows, 1: input columns)
    over ``group``; this rank keeps its piece."""

    split_dim: ClassVar[int]

    def __init__(self, linear: nn.Linear, group: CommGroup, grain: int) -> None:
        super().__init__()
        self.group = group
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.widths = split_widths(linear.weight.shape[self.split_dim], group, grain)
        weight = _piece(linear.weight, self.split_dim, self.widths, group.rank)
        self.weight = _mark(nn.Parameter(weight), True)
        self.bias: nn.Parameter | None = None

    def _piece_repr(self) -> str:
        return f"this rank: {self.widths[self.group.rank]} of {self.group.world_size} pieces"


class ColumnParallelLinear(_SplitLinear):
    """``y = x W_r^T + b_r`` for this rank's output features ``r`` (see the module docs)."""

    split_dim = 0

    def __init__(
        self,
        linear: nn.Linear,
        group: CommGroup,
        *,
        gather_output: bool = False,
        grain: int = 1,
    ) -> None:
        super().__init__(linear, group, grain)
        self.gather_output = gather_output
        if linear.bias is not None:
            self.bias = _mark(nn.Parameter(_piece(linear.bias, 0, self.widths, group.rank)), True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group)
        y = nn.functional.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.group, self.widths)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self._piece_repr()}), gather_output={self.gather_output}"
        )


class RowParallelLinear(_SplitLinear):
    """``y = sum_r x_r W_r^T + b`` over the ranks' input features ``r`` (see the module docs).

    ``input_is_parallel``: the input is already this rank's features (a column-parallel
    linear's output); otherwise the whole input is given and this rank takes its piece."""

    split_dim = 1

    def __init__(
        self,
        linear: nn.Linear,
        group: CommGroup,
        *,
        input_is_parallel: bool = True,
        grain: int = 1,
    ) -> None:
        super().__init__(linear, group, grain)
        self.input_is_parallel = input_is_parallel
        if linear.bias is not None:
            self.bias = _mark(nn.Parameter(linear.bias.detach().clone()), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tensor_parallel(x, self.group, self.widths)
        y = reduce_from_tensor_parallel(nn.functional.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self._piece_repr()}), "
            f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}"
        )
