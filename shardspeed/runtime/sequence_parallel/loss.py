"""The loss of a sequence split over the sequence-parallel ranks, as DeepSpeed's ALST tutorial
and Hugging Face's Trainer combine it: every rank's shard loss (a mean over its good tokens)
weighted by its good-token count, summed over the group and divided by the group's good tokens:
the mean over every good token of the whole sequence, the same value on every rank.

The gather is differentiable: each rank's backward receives the gradient of the combined loss
with respect to its own shard loss from every rank, so the shard gradients, summed over the
group (ZeRO averages over data x sequence parallel ranks and so divides that sum by the
sequence-parallel size), give exactly the whole sequence's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardspeed import comm

__all__ = ["all_gather_differentiable", "sequence_parallel_loss"]


class _AllGather(torch.autograd.Function):
    """``tensor`` from every rank of ``group``, stacked along a new first dimension; the
    gradient of each rank's tensor is the sum over ranks of the gradient of its slot."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        ctx.rank = comm.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(comm.get_world_size(group))]
        comm.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        comm.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def all_gather_differentiable(tensor: Tensor, group: Any = None) -> Tensor:
    """``tensor`` of every rank of ``group`` stacked (``[world, *tensor.shape]``), with the
    backward ``torch.distributed.nn.functional.all_gather`` has (which on gloo fails for a
    group that does not hold global rank 0: it passes group ranks where global ones belong)."""
    return _AllGather.apply(tensor, group)


def sequence_parallel_loss(
    loss: Tensor, shift_labels: Tensor, group: Any = None, ignore_index: int = -100
) -> Tensor:
    """The whole sequence's mean loss from this rank's shard ``loss`` (a mean over the good
    tokens of ``shift_labels``, this rank's slice of the pre-shifted labels). A shard with no
    good token (all prompt or padding; its loss is NaN) counts zero."""
    good = (shift_labels != ignore_index).sum().to(loss.dtype)
    losses = all_gather_differentiable(loss, group)
    counts = all_gather_differentiable(good, group).detach()
    losses = torch.where(counts > 0, losses, torch.zeros_like(losses))
    return (losses * counts).sum() / counts.sum().clamp(min=1)
