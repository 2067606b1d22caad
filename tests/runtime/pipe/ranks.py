"""Rank-side code of the pipeline tests (run on every rank of a ``dist_pool``)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from examples.gpt_model import synthetic_tokens
from tests.runtime.parity import OPT_PARAMS, assert_close
from tests.runtime.pipe.gpt_pipe import TINY, Reference, loss_fn, pipeline_from


def config(micro: int, gas: int, clip: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
        **extra,
    }


class Batches:
    """This rank's micro-batches: global batch ``k`` is ``micro * gas * dp`` rows, data-parallel
    rank ``d`` takes micro-batch ``j`` at rows ``(d * gas + j) * micro``."""

    def __init__(self, data: Any, micro: int, gas: int, dp: int, dp_rank: int) -> None:
        self.data, self.micro, self.gas, self.dp, self.dp_rank = data, micro, gas, dp, dp_rank

    def step(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        base = k * self.micro * self.gas * self.dp
        out = []
        for j in range(self.gas):
            start = base + (self.dp_rank * self.gas + j) * self.micro
            rows = slice(start, start + self.micro)
            out.append((self.data.tensors[0][rows], self.data.tensors[1][rows]))
        return out

    def global_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.micro * self.gas * self.dp
        rows = slice(k * size, (k + 1) * size)
        return self.data.tensors[0][rows], self.data.tensors[1][rows]


def check_params(engine: Any, reference: Reference, what: str, rtol: float, atol: float) -> None:
    for index, layer in engine.module.layer_modules().items():
        expected = reference.layer(index).state_dict()
        for name, value in layer.state_dict().items():
            assert_close(value, expected[name], f"{what} layer {index} {name}", rtol, atol)


def train_parity(
    stages: int,
    steps: int = 10,
    micro: int = 2,
    gas: int = 4,
    clip: float = 0.1,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    module_kwargs: dict[str, Any] | None = None,
    **extra: Any,
) -> list[float]:
    """Pipeline training equals single-process training of the same layers on the same global
    batch: the loss every step (on every stage) and every stage's parameters.

    ``clip`` 0.1 clips every step, so the global norm over the stages (tied weight counted
    once) is exercised each time; a clip threshold the norm hovers around lets float64-vs-
    float32 rounding of the norm decide, and Adam turns that into 1e-5 on near-zero gradients
    (tests/runtime/parity.py). atol 1e-5 is the repository's parity tolerance for the same
    reason."""
    reference = Reference()
    module = pipeline_from(copy.deepcopy(reference), stages, **(module_kwargs or {}))
    engine, *_ = shardspeed.initialize(model=module, config=config(micro, gas, clip, **extra))
    grid = module.mpu()
    dp = grid.get_data_parallel_world_size()
    data = synthetic_tokens(steps * micro * gas * dp, TINY, seed=1)
    batches = Batches(data, micro, gas, dp, grid.get_data_parallel_rank())
    optimizer = torch.optim.AdamW(reference.parameters(), **OPT_PARAMS)
    losses = []
    for k in range(steps):
        loss = engine.train_batch(iter(batches.step(k)))
        tokens, targets = batches.global_batch(k)
        optimizer.zero_grad()
        expected = loss_fn(reference(tokens), targets)
        expected.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        optimizer.step()
        assert_close(loss, expected.detach(), f"step {k} loss", rtol, atol)
        check_params(engine, reference, f"step {k}", rtol, atol)
        losses.append(float(loss))
    assert engine.global_steps == steps
    engine.destroy()
    return losses


def world() -> int:
    return dist.get_world_size()
