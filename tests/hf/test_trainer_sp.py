"""The HF ``Trainer`` with DeepSpeed's ALST sequence parallelism (``ParallelismConfig(
sp_backend="deepspeed", sp_size=2)``) on 2 ranks, ZeRO 2 and ZeRO 3, trains the same losses
and weights as plain DDP on the same global batches (``scripts/trainer_sp_cases.py``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf.conftest import REPO, free_port, launch_cmd, rank_env, run_launched

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from trainer_sp_cases import CASES, MAX_STEPS, SP  # noqa: E402

#: fp32 on CPU: the sequence split changes only the order of float sums
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5


@pytest.mark.timeout(300)
def test_trainer_sequence_parallel_matches_ddp(compat_site: Path, tmp_path: Path) -> None:
    env = rank_env(compat_site)
    cmd = launch_cmd("shardspeed", "trainer_sp_cases.py", str(tmp_path), "--cases", ",".join(CASES))
    run_launched(cmd, env, timeout=280)
    results = {
        case: [json.loads((tmp_path / case / f"rank{r}.json").read_text()) for r in (0, 1)]
        for case in CASES
    }
    reference = results["ddp"][0]["losses"]
    assert sorted(reference) == [str(s) for s in range(1, MAX_STEPS + 1)]
    want = torch.load(tmp_path / "ddp" / "params.pt")
    for case in ("sp_z2", "sp_z3"):
        for rank, got in enumerate(results[case]):
            assert got["engine"] == "DeepSpeedEngine", case
            assert (got["sp_size"], got["dp_size"]) == (SP, 1), (case, rank)
            assert got["attn"] != "sdpa", (case, got["attn"])  # Ulysses wraps the core
            for step, loss in reference.items():
                assert got["losses"][step] == pytest.approx(loss, rel=LOSS_RTOL), (case, step)
        params = torch.load(tmp_path / case / "params.pt")
        for name, value in want.items():
            diff = (params[name] - value).abs().max() / value.abs().max()
            assert diff < WEIGHT_RTOL, (case, name, float(diff))


@pytest.mark.timeout(240)
def test_long_sequence_example_trains(compat_site: Path) -> None:
    """``examples/hf_long_seq.py`` (the README's loop) with tiling, on 2 ranks: it runs and the
    loss falls."""
    cmd = [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", "2",
           "--master_port", str(free_port()), str(REPO / "examples" / "hf_long_seq.py"),
           "--tiled", "--steps", "4"]  # fmt: skip
    done = subprocess.run(cmd, env=rank_env(compat_site), capture_output=True, text=True,
                          timeout=220, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"done: 4 steps .* loss ([\d.]+) -> ([\d.]+)", done.stdout)
    assert found, done.stdout[-2000:]
    assert float(found.group(2)) < float(found.group(1))
