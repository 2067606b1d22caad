"""``InferenceEngine.compile()``: the fused decoding step (fixed shapes) compiled once, or the
model's forward without fused decoding; greedy tokens and logits unchanged."""

from __future__ import annotations

import torch

import shardspeed
from tests.inference import models


def test_compiled_decode_step_gives_the_same_tokens():
    """Compiled with a tracing backend (fast here; the benchmark times inductor): the tokens of
    the dynamic step, for a second batch size too, and the step is compiled, not re-traced per
    token (one compiled step per cache)."""
    engine = models.fused("llama")
    ids = models.prompt(batch=2)
    want = models.greedy(engine, ids)
    engine.compile(backend="eager")
    assert engine.fused.decode_mode == "compiled"
    assert torch.equal(models.greedy(engine, ids), want)
    step = engine.fused._static
    assert step is not None and step.run_step != step._step  # the compiled callable
    assert torch.equal(models.greedy(engine, ids), want)
    assert engine.fused._static is step  # same batch: the compiled step is reused
    single = models.prompt(batch=1)
    engine.fused.decode_mode = "dynamic"
    want_single = models.greedy(engine, single)
    engine.fused.decode_mode = "compiled"
    assert torch.equal(models.greedy(engine, single), want_single)


def test_compile_without_fused_decoding_compiles_the_forward():
    model = models.build("gpt2")
    ids = models.prompt(batch=1)
    with torch.no_grad():
        want = model(ids).logits
    engine = shardspeed.init_inference(models.build("gpt2"), dtype=torch.float32)
    engine.compile(backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, want)
