"""Rank side of the engine.compile() test."""

from __future__ import annotations

from typing import Any

import torch

import shardspeed
from examples.gpt_model import GPT
from tests.runtime.parity import OPT_PARAMS, TINY_GPT, assert_close, train_global_losses


class CountingBackend:
    """``aot_eager`` that counts the graphs it compiles and the times compiled code runs, so the
    test sees that training went through the compiled model (a no-op compile would count 0)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        compiled = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def losses(
    stage: int, backend: str | CountingBackend | None, steps: int = 3
) -> tuple[list[float], bool]:
    """The GPT trained ``steps`` steps at ZeRO ``stage``, compiled with ``backend`` (None: not)."""
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
    out = train_global_losses(engine, TINY_GPT, steps, seed=2)
    compiled = engine.is_compiled
    engine.destroy()
    return out, compiled


def compiled_matches_eager(stage: int) -> list[float]:
    eager, was = losses(stage, None)
    assert not was
    counter = CountingBackend()
    compiled, was = losses(stage, counter)
    assert was
    # every training forward ran compiled code (graph breaks may add graphs, never remove runs)
    assert counter.graphs >= 1 and counter.runs >= len(compiled), (counter.graphs, counter.runs)
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
