"""A GPT-style model as pipeline layers (token embedding tied to the output projection by a
``TiedLayerSpec``), and the same layers as one single-process module for reference."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt_model import Block, GPTConfig
from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


class PositionEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wpe(torch.arange(x.shape[1], device=x.device))


def lm_head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output projection: the token embedding's weight, transposed."""
    return x @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def layer_specs(cfg: GPTConfig = TINY) -> list[Any]:
    return [
        TiedLayerSpec("embed", nn.Embedding, cfg.vocab_size, cfg.n_embd),
        LayerSpec(PositionEmbedding, cfg),
        *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.n_embd),
        TiedLayerSpec("embed", nn.Embedding, cfg.vocab_size, cfg.n_embd, forward_fn=lm_head),
    ]


class Reference(nn.Module):
    """The same layers in one process; ``layers[i]`` is global layer ``i`` (the tied head is
    the embedding module again)."""

    def __init__(self, cfg: GPTConfig = TINY, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        specs = layer_specs(cfg)
        built = [spec.build() for spec in specs[:-1]]
        for module in built:
            for param in module.parameters():
                if param.dim() > 1:
                    nn.init.normal_(param, std=0.1)
        self.layers = nn.ModuleList(built)

    def layer(self, index: int) -> nn.Module:
        return self.layers[0] if index == len(self.layers) else self.layers[index]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return lm_head(self.layers[0], x)


def pipeline_from(reference: Reference, num_stages: int, **kwargs: Any) -> PipelineModule:
    """A PipelineModule of the same layers, each stage's layers holding the reference's
    weights."""
    module = PipelineModule(layer_specs(), num_stages=num_stages, loss_fn=loss_fn, **kwargs)
    for index, layer in module.layer_modules().items():
        layer.load_state_dict(reference.layer(index).state_dict())
    return module
