"""The expert-parallel exchange: an all-to-all that autograd can run backwards.

Each rank's ``[E, C, M]`` expert buffers are split along the expert axis into ``ep_size`` equal
chunks, chunk ``p`` (the experts rank ``p`` holds) sent to expert-parallel rank ``p``; what
arrives is ``[ep_size, E / ep_size, C, M]`` ordered by source rank. Sending the experts' outputs
back is the same exchange, and so is the backward of either: the gradient of an all-to-all with
equal splits is the all-to-all of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardspeed import comm


def _exchange(group: comm.ProcessGroup, tensor: Tensor) -> Tensor:
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    comm.all_to_all_single(out, tensor, group=group, log_name="moe_all_to_all")
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: comm.ProcessGroup, tensor: Tensor) -> Tensor:
        ctx.group = group
        return _exchange(group, tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, _exchange(ctx.group, grad)


def all_to_all(group: comm.ProcessGroup, tensor: Tensor) -> Tensor:
    """Exchange equal dim-0 chunks of ``tensor`` over ``group`` (differentiable)."""
    return _AllToAll.apply(group, tensor)


def agree_capacity(capacity: int, group: comm.ProcessGroup, device: torch.device) -> int:
    """The largest ``capacity`` over ``group``: every rank's buffers must have one size for
    the exchange, also when ranks route different numbers of tokens."""
    value = torch.tensor([capacity], dtype=torch.int64, device=device)
    comm.all_reduce(value, op=comm.ReduceOp.MAX, group=group)
    return int(value.item())
