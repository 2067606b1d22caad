"""Rank-side code for parity tests: train a model with the engine on this rank's share of each
global batch, and a single-process reference on the whole batch, and compare step by step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardspeed
from examples.gpt_model import GPT, GPTConfig, synthetic_tokens
from shardspeed.ops.factory import build_optimizer

# Adam divides by sqrt(v) + eps: with eps=1e-8 an element whose gradient is ~1e-9 turns float
# summation-order noise (two half-batch means vs one full-batch mean) into 1e-6 weight changes.
# A larger eps keeps these tests about the data-parallel machinery, not Adam's conditioning.
EPS = 1e-6
TINY_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


@dataclass
class Task:
    """A model factory and a dataset of (input, target) rows."""

    build: Callable[[], nn.Module]
    data: tuple[torch.Tensor, torch.Tensor]


def make_task(kind: str, rows: int, seed: int = 0) -> Task:
    gen = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        x = torch.randn(rows, 16, generator=gen)
        w = torch.randn(16, 1, generator=gen) / 4
        y = torch.tanh(x @ w)
        return Task(lambda: MLP(), (x, y))
    if kind == "gpt":
        ds = synthetic_tokens(rows, TINY_GPT, seed=seed)
        return Task(lambda: GPT(TINY_GPT), (ds.tensors[0], ds.tensors[1]))
    raise ValueError(kind)


def adamw_config(micro: int, gas: int, clip: float, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": EPS, "weight_decay": 0.01}},
        **extra,
    }


def rank_rows(step: int, micro_step: int, micro: int, gas: int) -> slice:
    """Rows of the global batch this rank uses at ``micro_step``: global batches are laid out as
    ``gas`` micro-steps, each of ``world`` consecutive micro-batches."""
    world, rank = dist.get_world_size(), dist.get_rank()
    start = step * micro * gas * world + (micro_step * world + rank) * micro
    return slice(start, start + micro)


def global_rows(step: int, batch: int) -> slice:
    return slice(step * batch, (step + 1) * batch)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float, atol: float
) -> None:
    if not torch.allclose(actual.float(), expected.float(), rtol=rtol, atol=atol):
        diff = (actual.float() - expected.float()).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {diff:.3e} (rtol={rtol}, atol={atol})")


def reference_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, micro: int, gas: int, world: int
) -> torch.Tensor:
    """Single-process backward over the whole global batch of ``step``: the mean loss over all
    ``world * gas`` micro-batches. It is computed micro-batch by micro-batch in the float order a
    data-parallel run uses (each rank accumulates its micro-batches, then the ranks are summed
    and averaged); a one-shot full-batch backward differs only by rounding, but Adam amplifies
    rounding on near-zero gradient elements, which would hide the comparison."""
    batch = micro * gas * world
    rows = global_rows(step, batch)
    xs, ys = x[rows].split(micro), y[rows].split(micro)
    params = list(model.parameters())
    total = torch.zeros(())
    summed: list[torch.Tensor] | None = None
    for rank in range(world):
        local: list[torch.Tensor] | None = None
        for micro_step in range(gas):
            i = micro_step * world + rank
            loss = model(xs[i], ys[i])
            total += loss.detach()
            part = torch.autograd.grad(loss / gas if gas > 1 else loss, params)
            local = (
                list(part) if local is None else [a + b for a, b in zip(local, part, strict=True)]
            )
        assert local is not None
        summed = local if summed is None else [a + b for a, b in zip(summed, local, strict=True)]
    assert summed is not None
    for param, grad in zip(params, summed, strict=True):
        param.grad = grad * (1.0 / world)
    return total / (world * gas)


def run_parity(
    kind: str,
    gas: int,
    clip: float,
    steps: int = 20,
    micro: int = 2,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    config_extra: dict[str, Any] | None = None,
) -> list[float]:
    """Train ``steps`` optimizer steps both ways; assert losses and parameters match at every
    step. Returns the engine's global losses."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    task = make_task(kind, rows=steps * micro * gas * world)
    reference = task.build()
    model = copy.deepcopy(reference)
    engine, *_ = shardspeed.initialize(
        model=model, config=adamw_config(micro, gas, clip, **(config_extra or {}))
    )
    # the same optimizer class the config builds: this test is about data parallelism (each
    # optimizer is checked against its torch reference in tests/ops)
    ref_opt = build_optimizer(
        "AdamW", reference.parameters(), {"lr": 1e-2, "eps": EPS, "weight_decay": 0.01}
    )
    x, y = task.data
    losses = []
    for step in range(steps):
        ref_opt.zero_grad()
        ref_loss = reference_backward(reference, x, y, step, micro, gas, world)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()

        total = torch.zeros(())
        for micro_step in range(gas):
            mine = rank_rows(step, micro_step, micro, gas)
            loss = engine(x[mine], y[mine])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        global_loss = total / (world * gas)
        assert_close(global_loss, ref_loss.detach(), f"loss at step {step}", rtol, atol)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert_close(p.detach(), q.detach(), f"{name} at step {step}", rtol, atol)
        losses.append(global_loss.item())
    engine.destroy()
    return losses
