"""``shardspeed --autotuning tune`` over ``autotuning.pipeline_stages: [1, 2]`` on 2 CPU ranks:
real launches of a tiny ``PipelineModule`` script that takes its stage count through
``arg_mappings`` (one profile launch, then one trial per layout)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "autotuning" / "scripts" / "pipe_tune.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(600)
def test_pipeline_stages_are_tuned_through_the_script(tmp_path: Path) -> None:
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "autotuning": {
            "enabled": True,
            "tuner_type": "gridsearch",
            "tuner_early_stopping": 0,
            "start_profile_step": 1,
            "end_profile_step": 3,
            # one micro-batch size: 2 (accumulation 2 at pp 1 over 2 data-parallel ranks, 4 at
            # pp 2 with one pipeline)
            "min_train_micro_batch_size_per_gpu": 2,
            "max_train_micro_batch_size_per_gpu": 2,
            "pipeline_stages": [1, 2],
            "arg_mappings": {"autotuning.pipeline_stages": "--pipeline_stages"},
            "experiment_timeout_s": 240,
        },
        "zero_optimization": {"stage": 1},
    }
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardspeed.launcher.runner", "--autotuning", "tune",
           "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT),
           "--deepspeed_config", str(cfg), "--pipeline_stages", "1", "--steps", "10"]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "autotuning_results" / "results.json").read_text())
    expected = {
        "z1_pp1_mbs2_gas2": "pipe script: stages 1 micro 2 accum 2 dp 2",
        "z1_pp2_mbs2_gas4": "pipe script: stages 2 micro 2 accum 4 dp 1",
    }
    assert [r["name"] for r in rows] == list(expected), rows
    assert all(r["status"] == "ok" and r["metrics"]["throughput"] > 0 for r in rows), rows
    for name, seen in expected.items():  # each trial's script built that many stages
        out = (tmp_path / "autotuning_exps" / name / "stdout.log").read_text()
        assert seen in out, out[-2000:]
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert all(name in summary for name in expected)  # the table names both layouts
    # the profile ran at one stage, so its figures are the whole model's
    profile = json.loads(
        (tmp_path / "autotuning_exps" / "profile_model_info" / "ds_config.json").read_text()
    )
    assert profile["autotuning"]["pipeline_stages"] == 1 and profile["pipeline"]["stages"] == 1
    best = max(rows, key=lambda r: r["metrics"]["throughput"])["name"]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    stages = optimal["pipeline"]["stages"]
    assert best == f"z1_pp{stages}_mbs2_gas{2 * stages}"
    command = (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text()
    assert f"--pipeline_stages {stages}" in command
