"""Token exchange over the expert-parallel group: uneven all-to-all that autograd runs backwards.

Rank ``r`` sends ``send_counts[p]`` rows to rank ``p`` and receives ``recv_counts[p]`` rows from
it; the counts are agreed first by :func:`exchange_counts`. The backward of such an exchange is
the same exchange of the gradient with the two count lists swapped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardspeed import comm


def _exchange(group: Any, tensor: Tensor, send: list[int], recv: list[int]) -> Tensor:
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    comm.all_to_all_single(
        out,
        tensor.contiguous(),
        output_split_sizes=recv,
        input_split_sizes=send,
        group=group,
        log_name="autoep_all_to_all",
    )
    return out


class _UnevenAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, group: Any, tensor: Tensor, send: list[int], recv: list[int]
    ) -> Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _exchange(group, tensor, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:  # type: ignore[override]
        return None, _exchange(ctx.group, grad, ctx.recv, ctx.send), None, None


def uneven_all_to_all(group: Any, tensor: Tensor, send: list[int], recv: list[int]) -> Tensor:
    """Send ``send[p]`` dim-0 rows of ``tensor`` to rank ``p``; return the ``recv`` rows that
    arrive, ordered by source rank (differentiable)."""
    return _UnevenAllToAll.apply(group, tensor, send, recv)


def exchange_counts(group: Any, counts: Tensor, ep_size: int) -> Tensor:
    """``counts[e]`` rows go to global expert ``e``; returns ``[ep_size, local_experts]``: how
    many rows each source rank sends to each of this rank's experts."""
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts, group=group, log_name="autoep_counts")
    return received.view(ep_size, -1)
