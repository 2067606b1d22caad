"""Weight-only int8: ~1/4 of the fp32 weight bytes, logits close to fp32, ties kept.

The quality figures come from the tiny models trained briefly on a structured token stream
(``models.trained``): a random model's near-flat logits would let any perturbation flip the
greedy token, which says nothing about the quantizer."""

from __future__ import annotations

import pytest
import torch

import shardspeed
from shardspeed.inference.quantization import Int8Linear, quantize_int8
from tests.inference import models, ranks
from tests.inference.int8_quality import quality


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
def test_int8_bytes_and_quality(family):
    reference = models.trained(family)
    engine = shardspeed.init_inference(models.trained(family), dtype=torch.int8)
    figures = quality(reference, engine)
    print(family, figures)
    assert figures["bytes_ratio"] <= 0.27, figures
    assert figures["cosine"] > 0.999, figures
    assert abs(figures["ppl_int8"] / figures["ppl_fp32"] - 1) < 0.01, figures
    assert figures["argmax_agree"] > 0.97, figures
    assert figures["greedy_equal"] >= 0.75 * figures["greedy_total"], figures  # 8 x 32 tokens
    assert any(isinstance(m, Int8Linear) for m in engine.module.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.module.modules())


def test_group_wise_scales_and_tied_head_shares_rows():
    engine = shardspeed.init_inference(
        models.build("qwen3"), dtype="int8", quant={"weight": {"q_groups": 4}}
    )
    head, embed = engine.module.lm_head, engine.module.model.embed_tokens
    assert head.qweight is embed.qweight and head.scales.dim() == 1  # tied: per-row, shared
    assert engine.module.model.layers[0].mlp.up_proj.scales.shape == (192, 4)


def test_quantize_round_trip_and_kernel_path():
    weight = torch.randn(48, 64)
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.float16
    assert (
        q.float() * scales.float()[:, None] - weight
    ).abs().max() <= scales.float().max() / 2 + 1e-6
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(3, 5, 64)
    int8 = Int8Linear.from_linear(linear)
    dequantised = torch.nn.functional.linear(
        x, int8.qweight.float() * int8.scales.float()[:, None], linear.bias
    )
    torch.testing.assert_close(int8(x), dequantised, rtol=1e-4, atol=1e-4)
    row = x[:1, :1]  # a single row takes aten._weight_int8pack_mm
    torch.testing.assert_close(int8(row), dequantised[:1, :1], rtol=1e-4, atol=1e-4)


def test_bad_quant_settings_are_errors():
    with pytest.raises(ValueError, match="only 8-bit"):
        shardspeed.init_inference(
            models.build("llama"), dtype="int8", quant={"weight": {"num_bits": 4}}
        )
    with pytest.raises(ValueError, match="q_groups=3 does not divide"):
        shardspeed.init_inference(
            models.build("llama"), dtype="int8", quant={"weight": {"q_groups": 3}}
        )


def test_int8_under_tensor_parallel(dist_pool):
    for figures in dist_pool(2).run(ranks.int8_under_tp, "llama"):
        print(figures)
        assert figures["cosine"] > 0.999, figures
        assert figures["greedy_equal"] >= 0.75 * figures["greedy_total"], figures
        assert figures["bytes_ratio"] < 0.27 / 2 + 0.03, figures
