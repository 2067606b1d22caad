"""``enable_cuda_graph``: the fused decoding step with fixed shapes (whole cache, masked), run
eagerly on CPU, gives the dynamic step's (and Hugging Face eager's) greedy tokens; captured in a CUDA graph (CUDA only)
it gives the same tokens as without; anywhere else the setting is refused, naming the fix."""

from __future__ import annotations

import pytest
import torch

from shardspeed.inference.fused import static_step
from tests.inference import models, recording_accelerator

FAMILIES = ["llama", "qwen3", "gpt2"]


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = models.prompt(batch=3, length=9)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", FAMILIES)
def test_static_step_tokens_equal_dynamic_step(family):
    """The graph's body, run eagerly: the tokens of the dynamic step (which equal Hugging Face
    eager's, test_fused.py), also with the cache and the step's buffers reused."""
    engine = models.fused(family)
    ids = models.prompt(batch=2)
    want = models.greedy(engine, ids)
    engine.fused.decode_mode = "static"
    assert torch.equal(models.greedy(engine, ids), want)
    step = engine.fused._static
    assert step is not None and step.graph is None
    assert torch.equal(models.greedy(engine, ids), want)
    assert engine.fused._static is step  # same batch: same cache, same buffers


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_static_step_left_padded(family):
    """Positions from the mask (rotary and learned), padded slots masked in the whole cache."""
    engine = models.fused(family)
    engine.fused.decode_mode = "static"
    padded, mask = _padded_batch()
    kwargs = {"attention_mask": mask, "max_new_tokens": 20, "min_new_tokens": 20}
    want = models.build(family).generate(padded, do_sample=False, **kwargs)
    device = models.device_of(engine)
    kwargs["attention_mask"] = mask.to(device)
    assert torch.equal(engine.generate(padded.to(device), do_sample=False, **kwargs).cpu(), want)


def test_static_step_under_int8():
    ids = models.prompt()
    engine = models.fused("llama", dtype="int8")
    want = models.greedy(engine, ids)
    engine.fused.decode_mode = "static"
    assert torch.equal(models.greedy(engine, ids), want)


def test_cuda_graph_refused_off_cuda():
    if torch.cuda.is_available():
        pytest.skip("the accelerator is CUDA here")
    with pytest.raises(ValueError, match="CUDA graphs exist only on CUDA devices") as error:
        models.fused("llama", enable_cuda_graph=True)
    assert "runs on cpu;" in str(error.value)  # keep_module_on_host is not blamed
    with pytest.raises(ValueError, match="keep_module_on_host=True"):
        models.fused("llama", enable_cuda_graph=True, keep_module_on_host=True)


def test_static_step_refuses_a_full_cache():
    engine = models.fused("llama", max_out_tokens=16)
    engine.fused.decode_mode = "static"
    with pytest.raises(ValueError, match="raise max_out_tokens"):
        engine.generate(models.prompt(), max_new_tokens=10)  # 7 + 10 > 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_tokens_equal_without_graph(family):
    ids = models.prompt(batch=2).cuda()
    plain = models.fused(family)
    graphed = models.fused(family, enable_cuda_graph=True)
    assert graphed.fused.decode_mode == "cuda_graph"
    want = models.greedy(plain, ids)
    assert torch.equal(models.greedy(graphed, ids), want)
    assert graphed.fused._static.graph is not None  # captured once, replayed per token
    assert torch.equal(models.greedy(graphed, ids), want)  # replayed with new inputs
    padded, mask = (t.cuda() for t in _padded_batch())
    kwargs = {"attention_mask": mask, "max_new_tokens": 20, "min_new_tokens": 20}
    want = plain.generate(padded, do_sample=False, **kwargs)
    assert torch.equal(graphed.generate(padded, do_sample=False, **kwargs), want)


def test_graph_captured_once_per_cache_and_replayed_per_token(monkeypatch):
    """The orchestration without a GPU: one capture at the first decode step, a replay at every
    decode step (the capturing one included), no recapture while the cache is reused, a new
    capture when a new batch size reallocates the cache."""
    recorder = recording_accelerator.install(monkeypatch, static_step)
    engine = models.fused("llama")
    engine.fused.decode_mode = "cuda_graph"
    ids = models.prompt(batch=2)
    models.greedy(engine, ids)  # 32 tokens: the prompt step gives the first, 31 decode steps
    assert (recorder.created, recorder.captured, recorder.replayed) == (1, 1, 31)
    models.greedy(engine, ids)
    assert (recorder.created, recorder.captured, recorder.replayed) == (1, 1, 62)
    models.greedy(engine, models.prompt(batch=3))
    assert (recorder.created, recorder.captured, recorder.replayed) == (2, 2, 93)
