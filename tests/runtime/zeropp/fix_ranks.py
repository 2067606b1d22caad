"""Rank-side code of ZeRO++ edge cases found in review: integer parameters under qwZ, a
``safe_set_full_fp32_param`` write under hpZ, frozen int8 weights reloaded at another world size
(every rank runs these with ``LOCAL_WORLD_SIZE=2``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardspeed
from shardspeed import comm
from shardspeed.utils import safe_set_full_fp32_param
from tests.runtime.zeropp.ranks import node_size


def _engine(model: nn.Module, zeropp: dict[str, Any]) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            **zeropp,
        },
    }
    trained = [p for p in model.parameters() if p.requires_grad]
    with node_size(2):
        engine, *_ = shardspeed.initialize(model=model, model_parameters=trained, config=config)
    return engine


class WithIndex(nn.Module):
    """A linear layer beside a frozen integer parameter the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.index = nn.Parameter(torch.arange(1000) * 7919 % 100003, requires_grad=False)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.index.detach().clone()


def integer_parameter_seen(zeropp: dict[str, Any]) -> int:
    """How many elements of the integer parameter the forward sees wrong."""
    torch.manual_seed(0)
    model = WithIndex()
    want = model.index.detach().clone()
    engine = _engine(model, zeropp)
    _, seen = engine(torch.randn(2, 4))
    engine.destroy()
    return int((seen != want).sum())


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 64)
        self.c = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x)))


def set_weight_then_forward(zeropp: dict[str, Any]) -> float:
    """Train a step, run an eval forward (hpZ keeps secondaries), zero ``c.weight`` with
    ``safe_set_full_fp32_param``: how far the next forward's output is from ``c.bias``."""
    torch.manual_seed(0)
    engine = _engine(Stack(), zeropp)
    x = torch.randn(2, 24, generator=torch.Generator().manual_seed(comm.get_rank()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    with torch.no_grad():
        engine(x)
    safe_set_full_fp32_param(engine.module.c.weight, torch.zeros(10, 64))
    with torch.no_grad():
        out = engine(x)
    with shardspeed.zero.GatheredParameters([engine.module.c.bias]):
        bias = engine.module.c.bias.detach().clone()
    engine.destroy()
    return float((out - bias).abs().max())


class Adapted(nn.Module):
    """A frozen base layer with a trained low-rank adapter (the LoRA case)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(128, 300)
        self.down = nn.Linear(128, 4, bias=False)
        self.up = nn.Linear(4, 300, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


FROZEN = {"zero_quantized_nontrainable_weights": True}


def _frozen_values(engine: Any) -> dict[str, torch.Tensor]:
    with shardspeed.zero.GatheredParameters(list(engine.module.base.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.base.named_parameters()}


def save_frozen(path: str) -> dict[str, torch.Tensor]:
    """Train the adapter a step with frozen int8 weights, save; the frozen values."""
    torch.manual_seed(0)
    engine = _engine(Adapted(), FROZEN)
    engine.backward(engine(torch.randn(2, 128)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(path, tag="frozen")
    values = _frozen_values(engine)
    engine.destroy()
    return values


def load_frozen(path: str) -> dict[str, torch.Tensor]:
    """The frozen values after loading ``path`` with frozen int8 weights."""
    torch.manual_seed(1)
    engine = _engine(Adapted(), FROZEN)
    engine.load_checkpoint(path, tag="frozen")
    values = _frozen_values(engine)
    engine.destroy()
    return values
