"""FLOPs profiler: exact analytic totals for a Linear stack, a conv net and a GPT block, module
attribution, restoring the functionals, and the printed report."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt_model import Block, GPTConfig
from shardspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile


def _profile(model: nn.Module, *inputs: torch.Tensor) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        model(*inputs)
    prof.stop_profile()
    return prof


def test_linear_stack_exact() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh())
    prof = _profile(model, torch.randn(3, 5, 8))
    rows = 3 * 5
    macs = rows * 8 * 16 + rows * 16 * 4
    assert prof.get_total_macs() == macs
    assert prof.get_total_flops() == 2 * macs + rows * 16 + rows * 4  # + ReLU + Tanh elements
    assert prof.get_total_params() == 8 * 16 + 16 + 16 * 4 + 4
    assert prof.module_flops(model[2]) == 2 * rows * 16 * 4
    assert prof.get_total_duration() > 0
    prof.end_profile()


def test_conv_net_exact() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 4, 3, stride=2, bias=False),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 10),
    ).eval()
    batch = 2
    prof = _profile(model, torch.randn(batch, 3, 16, 16))
    conv1_out = batch * 8 * 16 * 16
    conv1_macs = conv1_out * 3 * 9
    conv2_out = batch * 4 * 3 * 3  # (8 - 3) // 2 + 1 = 3
    conv2_macs = conv2_out * 8 * 9
    linear_macs = batch * 36 * 10
    expected = (
        2 * conv1_macs + conv1_out  # conv + bias
        + conv1_out  # relu
        + conv1_out  # max pool reads every input element
        + 2 * conv2_macs
        + 5 * conv2_out  # affine batch norm
        + 2 * linear_macs
    )  # fmt: skip
    assert prof.get_total_macs() == conv1_macs + conv2_macs + linear_macs
    assert prof.get_total_flops() == expected


def test_gpt_block_exact() -> None:
    cfg = GPTConfig(n_embd=32, n_head=4, block_size=16)
    block = Block(cfg).eval()
    batch, seq, width = 2, 16, cfg.n_embd
    prof = _profile(block, torch.randn(batch, seq, width))
    rows = batch * seq
    head = width // cfg.n_head
    qkv = 2 * rows * width * 3 * width
    attn = 2 * (batch * cfg.n_head * seq * seq * head) * 2  # Q K^T and A V
    proj = 2 * rows * width * width
    mlp = 2 * rows * width * 4 * width * 2 + rows * 4 * width  # two linears + GELU
    norms = 2 * 5 * rows * width
    assert prof.get_total_flops() == qkv + attn + proj + mlp + norms
    assert prof.module_flops(block.attn) == qkv + attn + proj
    assert prof.get_total_macs() == (qkv + attn + proj) // 2 + 2 * rows * width * 4 * width


def test_tensor_matmuls_and_restoration() -> None:
    originals = (F.linear, torch.matmul, torch.Tensor.__matmul__, torch.bmm)
    a, b = torch.randn(4, 5, 6), torch.randn(4, 6, 7)

    class Ops(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.bmm(x, y) + (x @ y) + torch.matmul(x, y) + x.matmul(y)

    prof = _profile(Ops(), a, b)
    assert prof.get_total_flops() == 4 * 2 * 4 * 5 * 6 * 7
    prof.end_profile()
    assert (F.linear, torch.matmul, torch.Tensor.__matmul__, torch.bmm) == originals
    assert "matmul" not in torch.Tensor.__dict__


def test_get_model_profile_and_report(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flops, macs, params = get_model_profile(
        model, input_shape=(3, 8), print_profile=False, as_string=False
    )
    assert (flops, macs, params) == (
        2 * 3 * 8 * 16 + 3 * 16 + 2 * 3 * 16 * 4,
        3 * 8 * 16 + 3 * 16 * 4,
        212,
    )
    out = tmp_path / "profile.txt"
    text_flops, _, _ = get_model_profile(model, input_shape=(3, 8), output_file=str(out))
    assert text_flops == "1.20 KFLOPS"
    report = out.read_text()
    assert "DeepSpeed Flops Profiler" in report and "Detailed Profile per GPU" in report
    assert "(2): Linear(68 = 32.08% Params, 192 MACs" in report
