"""Exact ring attention over a sequence split into contiguous blocks, one per rank of a group.

Rank ``i`` of the ring holds block ``i`` of the queries, keys and values (HF layout
``[batch, heads, block, head_dim]``). The forward pass keeps the queries in place and passes
the key/value block around the ring ``n - 1`` times; each block's attention is merged into the
running output with its log-sum-exp (the online softmax of flash attention), so the result is
exactly softmax attention over the whole sequence. With a causal mask, block ``j`` is skipped
by queries of block ``i < j`` and masked triangularly when ``i == j``.

The backward pass recomputes each block's probabilities from the saved log-sum-exp and passes
the key/value block around again, now with its gradient accumulator travelling beside it; one
last hop hands every accumulator back to the rank that owns its block. Grouped-query attention
is done by head grouping (query heads ``[g * k, (g + 1) * k)`` read key/value head ``g``), so
key/value heads are never copied. Scores and accumulators are kept in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardspeed import comm

__all__ = ["RingGroup", "ring_attention"]

_KV_TAG, _GRAD_TAG = 0, 1


class RingGroup:
    """The ranks of one ring, in order: this rank's block index is its place in the group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ranks = comm.get_all_ranks_from_group(group)
        self.size = len(self.ranks)
        self.index = self.ranks.index(comm.get_rank())

    def shift_start(self, tensor: Tensor, tag: int) -> tuple[list[Any], Tensor]:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's into a
        new buffer; returns the work handles and the buffer."""
        if self.size == 1:
            return [], tensor
        received = torch.empty_like(tensor)
        nxt = self.ranks[(self.index + 1) % self.size]
        prev = self.ranks[(self.index - 1) % self.size]
        # post the receive first: a ring of sends with nobody receiving could stall
        works = [
            comm.irecv(received, prev, group=self.group, tag=tag),
            comm.isend(tensor.contiguous(), nxt, group=self.group, tag=tag),
        ]
        return works, received

    @staticmethod
    def finish(works: list[Any], received: Tensor) -> Tensor:
        for work in works:
            work.wait()
        return received

    def shift(self, tensor: Tensor, tag: int) -> Tensor:
        """``tensor`` of the previous rank (this rank's goes to the next one)."""
        return self.finish(*self.shift_start(tensor, tag))


def _scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    """``[b, kv, group, Lq, Lk]`` scaled scores, upper triangle at -inf on the diagonal block."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if diagonal:
        lq, lk = scores.shape[-2:]
        above = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _visible(causal: bool, src: int, index: int) -> bool:
    """Whether queries of block ``index`` see any key of block ``src``."""
    return not causal or src <= index


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        ring: RingGroup,
        causal: bool,
        scale: float,
    ) -> Tensor:
        b, hq, length, d = query.shape
        hkv = key.shape[1]
        q = query.float().reshape(b, hkv, hq // hkv, length, d)
        kv = torch.stack((key, value))
        out: Tensor | None = None
        lse: Tensor | None = None
        for step in range(ring.size):
            src = (ring.index - step) % ring.size
            pending = ring.shift_start(kv, _KV_TAG) if step < ring.size - 1 else None
            # step 0 is this rank's own block: never skipped, so ``lse`` is finite from then on
            if _visible(causal, src, ring.index):
                scores = _scores(q, kv[0].float(), scale, causal and src == ring.index)
                block_lse = torch.logsumexp(scores, dim=-1)
                block_out = torch.matmul(
                    torch.exp(scores - block_lse.unsqueeze(-1)), kv[1].float().unsqueeze(2)
                )
                if out is None or lse is None:
                    out, lse = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse, block_lse)
                    out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(
                        block_lse - merged
                    ).unsqueeze(-1)
                    lse = merged
            if pending is not None:
                kv = ring.finish(*pending)
        assert out is not None and lse is not None
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out.reshape(b, hq, length, d).to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        query, key, value, out, lse = ctx.saved_tensors
        ring: RingGroup = ctx.ring
        scale: float = ctx.scale
        b, hq, length, d = query.shape
        hkv = key.shape[1]
        q = query.float().reshape(b, hkv, hq // hkv, length, d)
        dout = grad_out.float().reshape(q.shape)
        # the softmax backward's row term: sum_j p_ij * dp_ij = dout_i . out_i
        row = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack((key, value))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(ring.size):
            src = (ring.index - step) % ring.size
            pending = ring.shift_start(kv, _KV_TAG) if step < ring.size - 1 else None
            if _visible(ctx.causal, src, ring.index):
                k, v = kv[0].float().unsqueeze(2), kv[1].float().unsqueeze(2)
                probs = torch.exp(
                    _scores(q, kv[0].float(), scale, ctx.causal and src == ring.index)
                    - lse.unsqueeze(-1)
                )
                dkv[1] += torch.matmul(probs.transpose(-1, -2), dout).sum(dim=2)
                dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - row)
                dq += torch.matmul(dscores, k) * scale
                dkv[0] += torch.matmul(dscores.transpose(-1, -2), q).sum(dim=2) * scale
            # the accumulator follows its block; after the last step one more hop takes it home
            dkv = ring.shift(dkv, _GRAD_TAG)
            if pending is not None:
                kv = ring.finish(*pending)
        grad_q = dq.reshape(query.shape).to(query.dtype)
        return grad_q, dkv[0].to(key.dtype), dkv[1].to(value.dtype), None, None, None


def ring_attention(
    query: Tensor, key: Tensor, value: Tensor, group: Any, *, causal: bool, scale: float
) -> Tensor:
    """Softmax attention of this rank's query block over the keys and values of every block
    of the ring ``group`` (a process group; None: the world), ``[batch, heads, block, dim]``
    in and out. Key/value heads must divide the query heads; every rank's block has the same
    length. Differentiable in ``query``, ``key`` and ``value``."""
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        raise ValueError(
            "ring_attention takes [batch, heads, block, head_dim] tensors with key and value "
            f"of one shape; got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)}"
        )
    if query.shape[1] % key.shape[1] or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"ring_attention: {query.shape[1]} query heads over {key.shape[1]} key/value heads "
            f"and blocks of {query.shape[2]} / {key.shape[2]} tokens; the key/value heads must "
            "divide the query heads and the blocks be equally long"
        )
    ring = group if isinstance(group, RingGroup) else RingGroup(group)
    out: Tensor = _RingAttention.apply(query, key, value, ring, causal, float(scale))
    return out
