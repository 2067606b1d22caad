"""The exchanges between tensor-parallel ranks, as autograd functions.

Megatron's pair: entering a column-parallel region the input is used whole by every rank, so
its gradient is the sum of every rank's (:func:`copy_to_tensor_parallel`: identity forward,
all-reduce backward); leaving a row-parallel region each rank holds a partial sum
(:func:`reduce_from_tensor_parallel`: all-reduce forward, identity backward). Gathering a
column-parallel output (:func:`gather_from_tensor_parallel`) concatenates the ranks' pieces of
the last dimension, possibly of different widths, and hands each rank its piece of the gradient
back; :func:`split_to_tensor_parallel` is its converse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardspeed.runtime.zero.comm_group import CommGroup

__all__ = [
    "copy_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "split_to_tensor_parallel",
]


def _all_reduce(tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
    out = tensor.contiguous().clone()
    group.all_reduce(out)
    return out


def _gather_last(tensor: torch.Tensor, group: CommGroup, widths: Sequence[int]) -> torch.Tensor:
    """Every rank's ``tensor`` (last dimension ``widths[rank]``) concatenated along it."""
    widest = max(widths)
    pad = widest - tensor.shape[-1]
    padded = torch.nn.functional.pad(tensor, (0, pad)).contiguous() if pad else tensor.contiguous()
    stacked = torch.empty(
        (group.world_size, *padded.shape), dtype=padded.dtype, device=padded.device
    )
    group.all_gather(stacked, padded.unsqueeze(0))
    return torch.cat([stacked[r][..., : widths[r]] for r in range(group.world_size)], dim=-1)


def _my_piece(tensor: torch.Tensor, group: CommGroup, widths: Sequence[int]) -> torch.Tensor:
    start = sum(widths[: group.rank])
    return tensor[..., start : start + widths[group.rank]].contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, widths: Sequence[int]) -> torch.Tensor:
        ctx.group, ctx.widths = group, widths
        return _gather_last(x, group, widths)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _my_piece(grad, ctx.group, ctx.widths), None, None


class _SplitToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, widths: Sequence[int]) -> torch.Tensor:
        ctx.group, ctx.widths = group, widths
        return _my_piece(x, group, widths)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_last(grad, ctx.group, ctx.widths), None, None


def copy_to_tensor_parallel(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``group``."""
    if not group.partitioned:
        return x
    out: torch.Tensor = _CopyToTensorParallel.apply(x, group)
    return out


def reduce_from_tensor_parallel(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """``x`` summed over ``group``; the gradient passes through."""
    if not group.partitioned:
        return x
    out: torch.Tensor = _ReduceFromTensorParallel.apply(x, group)
    return out


def gather_from_tensor_parallel(
    x: torch.Tensor, group: CommGroup, widths: Sequence[int]
) -> torch.Tensor:
    """The ranks' pieces of the last dimension (rank ``r``'s ``widths[r]`` wide) concatenated;
    each rank gets its piece of the gradient."""
    if not group.partitioned:
        return x
    out: torch.Tensor = _GatherFromTensorParallel.apply(x, group, tuple(widths))
    return out


def split_to_tensor_parallel(
    x: torch.Tensor, group: CommGroup, widths: Sequence[int]
) -> torch.Tensor:
    """This rank's piece of ``x``'s last dimension; the gradient is gathered whole."""
    if not group.partitioned:
        return x
    out: torch.Tensor = _SplitToTensorParallel.apply(x, group, tuple(widths))
    return out
