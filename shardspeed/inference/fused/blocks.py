"""Fused decoder blocks: Llama-style (RMSNorm, rotary, gated MLP with one gate/up matmul) and
GPT-2-style (LayerNorm, learned positions, plain MLP)."""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.inference.fused.attention import FusedAttention, Step

__all__ = ["GatedBlock", "PlainBlock"]


class GatedBlock(nn.Module):
    """Pre-norm block with a gated MLP: ``down(act(gate) * up)``, gate and up in one matmul."""

    def __init__(
        self,
        norms: tuple[nn.Module, nn.Module],
        attn: FusedAttention,
        gate_up: nn.Module,
        act: nn.Module,
        down: nn.Module,
    ) -> None:
        super().__init__()
        self.norm1, self.norm2 = norms
        self.attn, self.gate_up, self.act, self.down = attn, gate_up, act, down

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        h = x + self.attn(self.norm1(x), step)
        gate, up = self.gate_up(self.norm2(h)).chunk(2, dim=-1)
        out: torch.Tensor = h + self.down(self.act(gate) * up)
        return out


class PlainBlock(nn.Module):
    """Pre-norm block with the model's own MLP module (GPT-2)."""

    def __init__(
        self, norms: tuple[nn.Module, nn.Module], attn: FusedAttention, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.norm1, self.norm2 = norms
        self.attn, self.mlp = attn, mlp

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        h = x + self.attn(self.norm1(x), step)
        out: torch.Tensor = h + self.mlp(self.norm2(h))
        return out
