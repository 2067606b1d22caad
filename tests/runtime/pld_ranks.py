"""Rank-side code of tests/runtime/test_progressive_layer_drop.py (run on a one-rank pool)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.pipe import PipelineModule

WIDTH = 4


def _config(gas: int = 1, **pld: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
    }
    if pld:
        config["progressive_layer_drop"] = pld
    return config


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, WIDTH, generator=gen), torch.randn(2, 1, generator=gen)


class KwargsRecorder(nn.Module):
    """A linear regression that records the keyword arguments of every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, 1)
        self.seen: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.seen.append(dict(kwargs))
        return F.mse_loss(self.head(x), y)


class DroppingStack(nn.Module):
    """Residual layers that PLD skips as DeepSpeed's BERT example does: layer ``i`` of ``L`` is
    kept with probability ``1 - i / L * (1 - pld_theta)``. Counts, per layer, how often it
    ran and the sum of the keep probabilities it was given (the expected count)."""

    def __init__(self, depth: int, seed: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)
        self.draws = torch.Generator().manual_seed(seed)
        self.kept = [0] * depth
        self.expected = [0.0] * depth
        self.forwards = 0

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        progressive_layer_drop: bool = False,
        pld_theta: float = 1.0,
    ) -> torch.Tensor:
        depth = len(self.layers)
        self.forwards += 1
        for i, layer in enumerate(self.layers):
            keep = 1.0 - i / depth * (1.0 - pld_theta) if progressive_layer_drop else 1.0
            self.expected[i] += keep
            if float(torch.rand((), generator=self.draws)) < keep:
                self.kept[i] += 1
                x = x + torch.tanh(layer(x))
        return F.mse_loss(self.head(x), y)


def kwargs_per_step(theta: float, gamma: float, gas: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps of ``gas`` micro-batches with PLD on; return the PLD
    keywords each training forward received (per step), ``get_pld_theta()`` after each step,
    and the keywords of one evaluation forward."""
    model = KwargsRecorder()
    engine, *_ = shardspeed.initialize(
        model=model, config=_config(gas, enabled=True, theta=theta, gamma=gamma)
    )
    assert engine.progressive_layer_drop is not None
    assert (engine.pld_enabled(), engine.pld_theta(), engine.pld_gamma()) == (True, theta, gamma)
    seen: list[list[dict[str, Any]]] = []
    after: list[float | None] = []
    for step in range(steps):
        start = len(model.seen)
        for micro in range(gas):
            engine.backward(engine(*_batch(step * gas + micro)))
            engine.step()
        seen.append(model.seen[start:])
        after.append(engine.get_pld_theta())
    engine.eval()
    with torch.no_grad():
        engine(*_batch(0))
    eval_kwargs = model.seen[-1]
    engine.destroy()
    return {"seen": seen, "after": after, "eval": eval_kwargs}


def disabled_passes_nothing() -> dict[str, Any]:
    """PLD off (the default): the model gets no PLD keywords and the engine has no schedule."""
    model = KwargsRecorder()
    engine, *_ = shardspeed.initialize(model=model, config=_config())
    for step in range(3):
        engine.backward(engine(*_batch(step)))
        engine.step()
    result = {
        "seen": model.seen,
        "theta": engine.get_pld_theta(),
        "schedule": engine.progressive_layer_drop,
        "enabled": engine.pld_enabled(),
    }
    engine.destroy()
    return result


def drop_counts(theta: float, gamma: float, depth: int, steps: int) -> dict[str, Any]:
    """Train ``DroppingStack`` for ``steps`` steps with PLD; return its per-layer counts."""
    torch.manual_seed(0)
    model = DroppingStack(depth, seed=1234)
    engine, *_ = shardspeed.initialize(
        model=model, config=_config(1, enabled=True, theta=theta, gamma=gamma)
    )
    for step in range(steps):
        engine.backward(engine(*_batch(step)))
        engine.step()
    result = {
        "kept": model.kept,
        "expected": model.expected,
        "forwards": model.forwards,
        "final_theta": engine.get_pld_theta(),
    }
    engine.destroy()
    return result


def pipeline_refuses_pld() -> str:
    """``initialize`` with a PipelineModule and PLD on: the error message."""
    module = PipelineModule(
        [nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)], num_stages=1, loss_fn=F.mse_loss
    )
    try:
        shardspeed.initialize(model=module, config=_config(enabled=True, theta=0.5))
    except ValueError as error:
        return str(error)
    raise AssertionError("initialize accepted progressive_layer_drop with a PipelineModule")


def resumed_theta(save_dir: str, theta: float, gamma: float, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps, save, load into a fresh engine: the PLD keywords of the next
    training forward in the unbroken run and in the resumed one."""
    config = _config(1, enabled=True, theta=theta, gamma=gamma)
    model = KwargsRecorder()
    engine, *_ = shardspeed.initialize(model=model, config=config)
    for step in range(steps):
        engine.backward(engine(*_batch(step)))
        engine.step()
    engine.save_checkpoint(save_dir, tag="pld")
    engine(*_batch(steps))
    unbroken = model.seen[-1]
    engine.destroy()
    fresh = KwargsRecorder()
    resumed, *_ = shardspeed.initialize(model=fresh, config=config)
    resumed.load_checkpoint(save_dir, tag="pld")
    resumed(*_batch(steps))
    result = {"unbroken": unbroken, "resumed": fresh.seen[-1], "steps": resumed.global_steps}
    resumed.destroy()
    return result
