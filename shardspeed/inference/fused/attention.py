"""Self-attention over a static KV cache: one QKV matmul, rotary embedding, SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.inference.fused.kv_cache import StaticKVCache

__all__ = ["FusedAttention", "Rope", "Step", "rotate_half"]

Rope = tuple[torch.Tensor, torch.Tensor] | None
"""(cos, sin) of the positions being run, each (1 or batch, tokens, head_dim); None: no rotary."""


@dataclass(frozen=True)
class Step:
    """What every layer needs for one forward step besides its input."""

    cache: StaticKVCache
    start: int | torch.Tensor
    """Cache slot of the step's first token; a one-element tensor for a static decoding step
    (one token, attending over the whole cache through ``mask``)."""
    rope: Rope
    mask: torch.Tensor | None = None
    """(batch, 1, tokens, start + tokens), True where a query may attend (padded batches);
    None: every earlier slot is a real token (causal within a multi-token step)."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class FusedAttention(nn.Module):
    """Attention of one layer: ``qkv`` projects to this rank's query, key and value heads in one
    matmul; keys and values go into the cache in place; ``out`` is the (row-parallel) output."""

    def __init__(
        self,
        qkv: nn.Module,
        out: nn.Module,
        heads: tuple[int, int, int],
        scale: float,
        layer: int,
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.qkv, self.out = qkv, out
        self.q_heads, self.kv_heads, self.head_dim = heads
        self.scale, self.layer = scale, layer
        self.q_norm: nn.Module | None = qk_norms[0] if qk_norms is not None else None
        self.k_norm: nn.Module | None = qk_norms[1] if qk_norms is not None else None
        self.widths = [self.q_heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(x).split(self.widths, dim=-1)
        q = q.view(batch, tokens, self.q_heads, self.head_dim)
        k = k.view(batch, tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        if step.rope is not None:
            cos, sin = step.rope[0].unsqueeze(1), step.rope[1].unsqueeze(1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if isinstance(step.start, torch.Tensor):
            assert tokens == 1 and step.mask is not None, "a static step is one masked token"
            keys, values = step.cache.write_at(self.layer, step.start, k, v)
        else:
            keys, values = step.cache.write(self.layer, step.start, k, v)
            # a prompt is run from slot 0 only, so "causal" lines up with the cache
            assert tokens == 1 or step.start == 0, "multi-token steps must start at slot 0"
        attn = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=step.mask,
            is_causal=tokens > 1 and step.mask is None,
            scale=self.scale,
            enable_gqa=self.q_heads != self.kv_heads,
        )
        out: torch.Tensor = self.out(attn.transpose(1, 2).reshape(batch, tokens, -1))
        return out
