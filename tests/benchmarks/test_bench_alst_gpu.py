"""benchmarks/bench_alst_gpu.py (ALST's single-device parts against Hugging Face's gradient
checkpointing, the GPU check's last part) at tiny sizes on CPU: one JSON line, the same losses
and gradients in both modes, a row per length."""

from __future__ import annotations

import pytest

from tests.benchmarks.tiny_run import tiny_run


@pytest.mark.timeout(120)
def test_tiny_run_matches_hugging_face() -> None:
    out = tiny_run("bench_alst_gpu.py", timeout=100)
    check = out["grad_check"]
    assert check["loss_hf"] == check["loss_alst"]
    assert check["max_rel_grad_diff"] < 1e-5  # fp32 on CPU: tiling changes only summation order
    assert [row["seq"] for row in out["runs"]] == [128, 512]
    for row in out["runs"]:
        assert row["hf_checkpointing"]["loss"] == row["alst"]["loss"], row
        assert row["alst"]["tokens_per_s"] > 0
