"""benchmarks/bench_alst_gpu.py (ALST's single-device parts against Hugging Face's gradient
checkpointing, the GPU check's last part) at tiny sizes on CPU: one JSON line, the same losses
and gradients in both modes, a row per length."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_tiny_run_matches_hugging_face() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_alst_gpu.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    check = out["grad_check"]
    assert check["loss_hf"] == check["loss_alst"]
    assert check["max_rel_grad_diff"] < 1e-5  # fp32 on CPU: tiling changes only summation order
    assert [row["seq"] for row in out["runs"]] == [128, 512]
    for row in out["runs"]:
        assert row["hf_checkpointing"]["loss"] == row["alst"]["loss"], row
        assert row["alst"]["tokens_per_s"] > 0
