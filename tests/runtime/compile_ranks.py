"""Rank side of the engine.compile() test."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardspeed
from examples.gpt_model import GPT, synthetic_tokens
from tests.runtime.parity import OPT_PARAMS, TINY_GPT, assert_close


def losses(stage: int, backend: str | None, steps: int = 3) -> tuple[list[float], bool]:
    """The GPT trained ``steps`` steps at ZeRO ``stage``, compiled with ``backend`` (None: not)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    if backend is not None:
        engine.compile(backend=backend)
    x, y = synthetic_tokens(steps * 2 * world, TINY_GPT, seed=2).tensors
    out = []
    for step in range(steps):
        rows = slice((step * world + rank) * 2, (step * world + rank + 1) * 2)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    compiled = engine.is_compiled
    engine.destroy()
    return out, compiled


def compiled_matches_eager(stage: int) -> list[float]:
    eager, was = losses(stage, None)
    assert not was
    compiled, was = losses(stage, "aot_eager")
    assert was
    for step, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert_close(torch.tensor(a), torch.tensor(b), f"loss at step {step}", 1e-5, 1e-6)
    return compiled


def deepcompile_refused() -> str:
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(
        model=GPT(TINY_GPT), config={"train_micro_batch_size_per_gpu": 2}
    )
    try:
        engine.compile(compiled_autograd_enabled=True)
    except NotImplementedError as error:
        return str(error)
    finally:
        engine.destroy()
    raise AssertionError("compiled_autograd_enabled=True was accepted")
