"""Fused decoding (replace_with_kernel_inject): greedy tokens identical to Hugging Face eager,
alone, under int8 and under tensor parallelism; fused weights cost no extra memory."""

from __future__ import annotations

import logging

import pytest
import torch

import shardspeed
from shardspeed.utils.logging import logger
from tests.inference import models, ranks

FAMILIES = ["llama", "qwen2", "qwen3", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf_eager(family):
    ids = models.prompt(batch=2)
    eager = models.build(family, attn_implementation="eager")
    engine = models.fused(family)
    assert engine.fused is not None
    calls = []
    engine.fused.register_forward_hook(lambda *_: calls.append(1))
    assert torch.equal(models.greedy(engine, ids), models.greedy(eager, ids))
    assert len(calls) == 32  # one prompt step, then one step per further token
    # prompt logits of the fused blocks equal the model's own
    cache = engine.fused.cache_for(2, torch.float32, ids.device)
    torch.testing.assert_close(engine.fused(ids, cache, 0, all_logits=True), eager(ids).logits)


def test_int8_fused_equals_int8_model_and_shares_weights():
    ids = models.prompt()
    plain = shardspeed.init_inference(models.build("llama"), dtype="int8")
    fused = models.fused("llama", dtype="int8")
    assert torch.equal(models.greedy(fused, ids), models.greedy(plain, ids))
    assert models.weight_bytes(fused.module) == models.weight_bytes(plain.module)
    attn = fused.module.model.layers[0].self_attn
    qkv = fused.fused.blocks[0].attn.qkv.qweight
    assert attn.q_proj.qweight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()


def test_eos_min_new_tokens_and_fallbacks(caplog):
    engine = models.fused("qwen2")
    eager = models.build("qwen2")
    ids = models.prompt()
    eos = int(models.greedy(eager, ids, 4)[0, 2])  # a token the model emits early
    for kwargs in ({"max_new_tokens": 12}, {"max_new_tokens": 12, "min_new_tokens": 6}):
        want = eager.generate(ids, eos_token_id=eos, pad_token_id=0, do_sample=False, **kwargs)
        got = engine.generate(ids, eos_token_id=eos, pad_token_id=0, do_sample=False, **kwargs)
        assert torch.equal(got, want), kwargs
    # beams are not fused: Hugging Face's generate runs them on the same (sharded) weights
    beams = engine.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)
    assert torch.equal(beams, eager.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False))
    with pytest.raises(ValueError, match="raise max_out_tokens"):
        engine.generate(ids, max_new_tokens=80)
    logger.propagate = True  # the shardspeed logger does not propagate to caplog by default
    try:
        with caplog.at_level(logging.INFO, logger="shardspeed"):
            windowed = shardspeed.init_inference(
                models.build("qwen2", use_sliding_window=True, sliding_window=16),
                dtype=torch.float32,
                replace_with_kernel_inject=True,
                max_out_tokens=64,
            )
    finally:
        logger.propagate = False
    assert windowed.fused is None
    assert "sliding-window attention" in caplog.text


def test_fused_under_tensor_parallel(dist_pool):
    # gpt2-odd-vocab: 251 vocabulary rows split 126/125, the logits gathered unevenly
    for equal in dist_pool(2).run(ranks.fused_tp_tokens, [*FAMILIES, "gpt2-odd-vocab"]):
        assert all(equal.values()), equal


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_left_padded_batch_equals_hf_eager(family):
    """Prompts of different lengths, left-padded: positions count real tokens only and padded
    slots are never attended, as in Hugging Face."""
    eager = models.build(family, attn_implementation="eager")
    engine = models.fused(family)
    ids = models.prompt(batch=3, length=9)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = {
        "attention_mask": mask,
        "max_new_tokens": 20,
        "min_new_tokens": 20,
        "do_sample": False,
    }
    calls = []
    engine.fused.register_forward_hook(lambda *_: calls.append(1))
    assert torch.equal(engine.generate(ids, **kwargs), eager.generate(ids, **kwargs))
    assert len(calls) == 20


class _Recorder:
    """A Hugging Face streamer that keeps every ``put`` and counts ``end``."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ends += 1


def test_streamer_sees_what_hf_streams():
    ids = models.prompt(batch=2)
    eager, engine = models.build("llama"), models.fused("llama")
    want, got = _Recorder(), _Recorder()
    calls: list[int] = []
    engine.fused.register_forward_hook(lambda *_: calls.append(1))
    eager.generate(ids, max_new_tokens=5, do_sample=False, streamer=want)
    out = engine.generate(ids, max_new_tokens=5, do_sample=False, streamer=got)
    assert len(calls) == 5  # the fused loop ran (not Hugging Face's generate)
    assert len(got.puts) == 6 and got.ends == want.ends == 1
    assert all(torch.equal(a, b) for a, b in zip(got.puts, want.puts, strict=True))
    assert torch.equal(torch.stack(got.puts[1:], dim=1), out[:, ids.shape[1] :])
