"""Small models and helpers shared by the activation-checkpointing tests (and their ranks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import shardspeed.checkpointing as ckpt


class Checkpointed(nn.Module):
    """Runs ``block`` through ``shardspeed.checkpointing.checkpoint`` when ``enabled``."""

    def __init__(self, block: nn.Module, enabled: bool) -> None:
        super().__init__()
        self.block = block
        self.enabled = enabled

    def forward(self, *args: Any) -> Any:
        return ckpt.checkpoint(self.block, *args) if self.enabled else self.block(*args)


def deep_mlp(width: int, layers: int, dropout: float = 0.0) -> list[nn.Module]:
    """``layers`` blocks of Linear -> Tanh (-> Dropout)."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        parts: list[nn.Module] = [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            parts.append(nn.Dropout(dropout))
        blocks.append(nn.Sequential(*parts))
    return blocks


def grads(module: nn.Module) -> list[torch.Tensor]:
    """Copies of every parameter's gradient, in order."""
    return [p.grad.detach().clone() for p in module.parameters()]


@contextmanager
def count_saved(exclude: nn.Module | None = None) -> Iterator[dict[str, Any]]:
    """Counts bytes and devices of tensors autograd saves inside the block, leaving out the
    parameters of ``exclude`` (weights are saved by reference, they are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude else set()
    record: dict[str, Any] = {"bytes": 0, "tensors": 0, "devices": set()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in params:
            record["bytes"] += tensor.numel() * tensor.element_size()
            record["tensors"] += 1
            record["devices"].add(tensor.device.type)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield record


def run_twice(
    build: Callable[[], nn.Module], step: Callable[[nn.Module, bool], torch.Tensor], seed: int = 7
) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]]]:
    """``(loss, grads)`` of ``step(model, checkpointing)`` without then with checkpointing, on
    identical models, each from RNG seed ``seed``."""
    results = []
    torch.manual_seed(0)
    reference = build()
    for enabled in (False, True):
        model = build()
        model.load_state_dict(reference.state_dict())
        torch.manual_seed(seed)
        loss = step(model, enabled)
        loss.backward()
        results.append((loss.detach(), grads(model)))
    return results[0], results[1]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Exact equality of two lists of tensors."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"tensor {i} differs: max {(x - y).abs().max().item():.3e}"
