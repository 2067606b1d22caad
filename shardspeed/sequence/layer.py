"""DeepSpeed-Ulysses (arXiv 2309.14509): attention over a sequence split across ranks.

Each rank of the sequence-parallel group holds a contiguous slice of the sequence for every
head. Before attention one all-to-all trades sequence for heads: every rank receives the whole
sequence for ``heads / P`` of the heads (split along ``scatter_idx``, joined along
``gather_idx``), runs the ordinary attention on it, and a second all-to-all trades back. Each
rank sends and receives ``(P - 1) / P`` of its activations per exchange, whatever the sequence
length, and the attention itself is exact: no approximation, no change to the model's math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from shardspeed import comm


def _exchange(tensor: Tensor, scatter_idx: int, gather_idx: int, group: Any) -> Tensor:
    """Split ``tensor`` into ``P`` chunks along ``scatter_idx``, send chunk ``i`` to rank ``i``,
    and join what arrives, in rank order, along ``gather_idx``."""
    world = comm.get_world_size(group)
    if tensor.shape[scatter_idx] % world != 0:
        raise ValueError(
            f"DistributedAttention: dimension {scatter_idx} of size {tensor.shape[scatter_idx]} "
            f"(the heads, by default) must be divisible by the sequence-parallel size {world}; "
            "choose a sequence-parallel size that divides the number of heads"
        )
    # one buffer with rank i's piece at index i of a new first dimension (one copy), exchanged
    # in place of separate chunks (gloo would pack and unpack them: two more copies at the peak)
    send = tensor.unflatten(scatter_idx, (world, -1)).movedim(scatter_idx, 0).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, group=group)
    del send
    # rank i's piece goes i-th along gather_idx: the rank dimension just before it, merged
    return received.movedim(0, gather_idx).flatten(gather_idx, gather_idx + 1)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, tensor: Tensor, scatter_idx: int, gather_idx: int) -> Tensor:
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        return _exchange(tensor, scatter_idx, gather_idx, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        # the inverse exchange: split what was joined, join what was split
        return None, _exchange(grad, ctx.gather_idx, ctx.scatter_idx, ctx.group), None, None


def sequence_all_to_all(tensor: Tensor, scatter_idx: int, gather_idx: int, group: Any) -> Tensor:
    """Differentiable exchange over ``group``: ``tensor`` split along ``scatter_idx`` (one
    piece per rank) and what the ranks send joined along ``gather_idx``, in rank order; the
    backward pass is the inverse exchange."""
    out: Tensor = _SeqAllToAll.apply(group, tensor, scatter_idx, gather_idx)
    return out


class DistributedAttention(nn.Module):
    """``local_attention(q, k, v, *args, **kwargs)`` run on the whole sequence for a share of
    the heads, given this rank's sequence slice of ``q``, ``k``, ``v``.

    ``scatter_idx`` is the heads dimension and ``gather_idx`` the sequence dimension of the
    inputs (DeepSpeed's defaults, 2 and 0, fit ``[sequence, batch, heads, head_dim]``); the
    output has the inputs' layout, this rank's sequence slice.
    """

    def __init__(
        self,
        local_attention: Callable[..., Tensor] | nn.Module,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream  # accepted for DeepSpeed's signature; exchanges run in order

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any
    ) -> Tensor:
        scatter, gather = self.scatter_idx, self.gather_idx
        q, k, v = (_SeqAllToAll.apply(self.spg, t, scatter, gather) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(self.spg, context, gather, scatter)
