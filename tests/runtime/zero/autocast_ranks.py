"""Rank-side code for the torch_autocast communication-dtype tests."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import shardspeed
from shardspeed.utils import safe_get_full_grad


class Block(nn.Module):
    """Linear (lower-precision-safe), LayerNorm (not), Linear: the interleaving a transformer has."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.norm(self.fc1(x))))
        return nn.functional.mse_loss(out.float(), y)


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def reduces_safe_modules_in_autocast_dtype(stage: int) -> None:
    """torch_autocast bf16: the gradients of Linear parameters are summed across ranks in bf16,
    LayerNorm's in fp32 (DeepSpeed's lower_precision_safe_modules), in two buckets."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    base = Block()
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(world, 4, 8, generator=gen)
    ys = torch.randn(world, 4, 1, generator=gen)
    per_rank = [_local_grads(base, xs[r], ys[r]) for r in range(world)]
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = shardspeed.initialize(
        model=copy.deepcopy(base), model_parameters=None, config=config
    )
    buckets = [b for g in engine.strategy.groups for b in g.buckets.buckets]
    # one bucket per comm dtype, not one per Linear/LayerNorm change
    assert sorted(str(b.comm_dtype or b.dtype) for b in buckets) == [
        "torch.bfloat16",
        "torch.float32",
    ]
    loss = engine(xs[rank], ys[rank])
    engine.backward(loss)
    lowered = 0.0
    for name, param in engine.module.named_parameters():
        grads = [g[name] for g in per_rank]
        fp32_mean = sum(grads) / world
        if name.startswith("norm."):
            expected = fp32_mean
        else:
            summed = grads[0].bfloat16()
            for g in grads[1:]:
                summed = summed + g.bfloat16()
            expected = summed.float() / world
            lowered = max(lowered, (expected - fp32_mean).abs().max().item())
        actual = safe_get_full_grad(param)
        assert actual is not None and actual.dtype == torch.float32, name
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-7, msg=name)
    assert lowered > 1e-5  # the bf16 sum is visibly not the fp32 one: the test can tell them apart
    engine.step()
    assert torch.isfinite(engine(xs[rank], ys[rank])).item()
    engine.destroy()
