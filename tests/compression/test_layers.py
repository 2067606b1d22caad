"""The pieces on their own: the quantizers, the MoQ bit schedule, the top-k mask and its
straight-through gradient, the compression-aware convolution (channel pruning shrinking the
next convolution and a BatchNorm), the embedding's per-token quantization, and
``convert_conv1d_to_linear``."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from shardspeed.compression import convert_conv1d_to_linear, init_compression, redundancy_clean
from shardspeed.compression.conv import shrink_batchnorm
from shardspeed.compression.layers import Embedding_Compress, LinearLayer_Compress
from shardspeed.compression.prune import topk_mask
from shardspeed.compression.quantize import fake_quantize, quantize, scheduled_bits


@pytest.mark.parametrize(("kind", "bits", "levels"), [("symmetric", 8, 255), ("asymmetric", 4, 16)])
def test_quantizer_levels_and_error(kind: str, bits: int, levels: int) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q = quantize(x, bits, kind, groups=8)
    for row, qrow in zip(x, q, strict=True):
        assert qrow.unique().numel() <= levels
        step = (row.max() - row.min()) / (levels - 1) if kind == "asymmetric" else None
        bound = step / 2 if step is not None else row.abs().max() / (2 ** (bits - 1) - 1) / 2
        assert (qrow - row).abs().max() <= bound + 1e-6
    assert quantize(x, 2).unique().numel() == 3  # ternary
    assert quantize(x, 1).unique().numel() == 2  # binary
    with pytest.raises(ValueError, match="quantize_groups=3 does not divide"):
        quantize(x, 8, groups=3)
    x.requires_grad_(True)
    fake_quantize(x, bits, kind).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight-through


def test_moq_bit_schedule() -> None:
    bits = [scheduled_bits(s, 8, 4, 3) for s in range(30)]
    # reductions after 3, 6, 12 and 24 steps on: the period doubles after each
    assert bits == [8] * 3 + [7] * 3 + [6] * 6 + [5] * 12 + [4] * 6
    assert scheduled_bits(10**6, 8, 8, 1) == 8


def test_topk_mask_counts_and_passes_gradients() -> None:
    scores = torch.tensor([0.3, -1.0, 2.0, 0.1, 0.5], requires_grad=True)
    mask = topk_mask(scores, 0.5)  # ceil(2.5) = 3 kept
    assert mask.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    (mask * torch.arange(5.0)).sum().backward()
    assert scores.grad.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_linear_l1_row_and_head_masks() -> None:
    torch.manual_seed(0)
    layer = LinearLayer_Compress.from_linear(nn.Linear(8, 6))
    layer.enable_row_pruning(0.5, "l1")
    layer.enable_head_pruning(0.5, "l1", num_heads=4)
    with torch.no_grad():
        layer.weight[1] *= 100  # the largest rows and the first head's columns survive
        layer.weight[:, :2] *= 50
    layer.activate("row_pruning")
    layer.activate("head_pruning")
    assert layer.get_mask("row").reshape(-1)[1] == 1 and layer.get_mask("row").sum() == 3
    assert layer.get_mask("head").reshape(-1).tolist()[0] == 1
    weight, bias = layer.compressed_weight()
    assert (weight.abs().sum(dim=1) == 0).sum() == 3 and (weight.abs().sum(dim=0) == 0).sum() == 4
    assert bias is not None and (bias == 0).sum() >= 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)))


def test_channel_pruning_shrinks_the_next_conv_and_batchnorm() -> None:
    torch.manual_seed(0)
    net = _Net()
    compression = {
        "channel_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 0},
            "different_groups": {
                "cp": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["conv1"],
                    "related_modules": [["conv2"]],
                }
            },
        }
    }
    config = {"compression_training": compression}
    init_compression(net, config)
    net.conv1.activate("channel_pruning")
    x = torch.randn(2, 3, 6, 6)
    masked = net(x)
    cleaned = redundancy_clean(copy.deepcopy(net), config)
    assert cleaned.conv1.weight.shape == (4, 3, 3, 3) and cleaned.conv1.bias.shape == (4,)
    assert cleaned.conv2.weight.shape == (4, 4, 3, 3)
    torch.testing.assert_close(cleaned(x), masked, rtol=1e-5, atol=1e-5)

    bn = nn.BatchNorm2d(4)
    bn.running_mean.copy_(torch.arange(4.0))
    shrink_batchnorm(bn, torch.tensor([True, False, True, False]))
    assert bn.num_features == 2 and bn.running_mean.tolist() == [0.0, 2.0]
    assert bn.weight.shape == (2,)


def test_embedding_quantizes_per_token_and_keeps_ties() -> None:
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    )
    compression = {
        "weight_quantization": {
            "shared_parameters": {"enabled": True},
            "different_groups": {
                "wq": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["wte"]}
            },
        }
    }
    init_compression(model, {"compression_training": compression})
    wte = model.transformer.wte
    assert isinstance(wte, Embedding_Compress) and model.lm_head.weight is wte.weight
    wte.activate("weight_quantization")
    out = wte(torch.arange(16))
    for row in out:  # per token: at most 15 symmetric 4-bit levels
        assert row.unique().numel() <= 15


def test_convert_conv1d_to_linear_keeps_outputs() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    ).eval()
    ids = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        before = model(ids).logits
        convert_conv1d_to_linear(model, transformers.pytorch_utils.Conv1D)
        after = model(ids).logits
    assert isinstance(model.transformer.h[0].attn.c_attn, nn.Linear)
    assert model.transformer.h[0].attn.c_attn.weight.shape == (24, 8)
    torch.testing.assert_close(after, before)
