"""benchmarks/bench_gpu.py (what scripts/gpu_check.sh runs on a lent GPU) at tiny sizes on CPU:
one JSON line with every mode, each ZeRO stage's loss curve on the plain-PyTorch peer's (same
seed and batches, bf16), and fused decoding giving eager's greedy tokens."""

from __future__ import annotations

import pytest

from tests.benchmarks.tiny_run import tiny_run


@pytest.mark.timeout(240)
def test_tiny_run_reports_every_mode() -> None:
    out = tiny_run("bench_gpu.py", timeout=220)
    train = out["train"]
    modes = ["stage0", "stage1", "stage2", "stage3", "stage2_offload_cpu", "stage3_offload_nvme"]
    for mode in ["torch_bf16_autocast", *modes]:
        figures = train[mode]
        assert figures["step_s"] > 0 and figures["tokens_per_s"] > 0, mode
        # bf16 weights and fp32 master copies track bf16 autocast over fp32 weights
        assert figures["max_loss_diff_vs_torch"] < 5e-3, (mode, figures)
    decode = out["decode"]
    assert decode["fused"]["tokens_equal_eager"] == 1.0
    assert decode["fused"]["decode_ms_per_token"] > 0
