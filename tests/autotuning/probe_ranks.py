"""Rank functions for test_probe.py: an engine in an autotuning experiment (or profile run)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

import shardspeed


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


def run_experiment_engine(section: dict[str, Any], micro: int, steps: int) -> dict[str, Any]:
    """Train until the probe ends the run; returns the step reached and the files written."""
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "autotuning": section,
    }
    engine, *_ = shardspeed.initialize(model=Tiny(), config=config)
    exited_at = None
    try:
        for _ in range(steps * 2):
            engine.backward(engine(torch.randn(micro, 8), torch.randn(micro, 1)))
            engine.step()
    except SystemExit as exc:
        assert exc.code == 0
        exited_at = engine.global_steps
    out: dict[str, Any] = {"exited_at": exited_at}
    for key in ("metric_path", "model_info_path"):
        path = section.get(key)
        if path and os.path.isfile(path):
            with open(path) as fd:
                out[key] = json.load(fd)
    return out
