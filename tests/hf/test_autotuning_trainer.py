"""``shardspeed --autotuning tune`` on a Hugging Face ``Trainer`` script (2 CPU ranks): the
micro-batch reaches the script through ``arg_mappings`` and agrees with the config's ``"auto"``
values the Trainer fills in (it refuses a mismatch), each trial is measured by the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf.conftest import SCRIPTS, free_port, rank_env


@pytest.mark.timeout(600)
def test_trainer_script_is_tuned_through_arg_mappings(compat_site: Path, tmp_path: Path) -> None:
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 0},
        "autotuning": {
            "enabled": True,
            "tuner_type": "model_based",
            "tuner_num_trials": 2,
            "start_profile_step": 1,
            "end_profile_step": 4,
            "min_train_micro_batch_size_per_gpu": 2,
            "max_train_micro_batch_size_per_gpu": 8,
            "num_tuning_micro_batch_sizes": 2,
            "arg_mappings": {
                "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                "gradient_accumulation_steps": "--gradient_accumulation_steps",
            },
        },
    }
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "shardspeed.launcher.runner", "--autotuning", "tune",
           "--num_gpus", "2", "--master_port", str(free_port()),
           str(SCRIPTS / "autotune_trainer.py"), "--deepspeed", str(cfg),
           "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "4"]  # fmt: skip
    done = subprocess.run(
        cmd, env=rank_env(compat_site), cwd=tmp_path, capture_output=True, text=True, timeout=560
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "autotuning_results" / "results.json").read_text())
    assert [r["name"] for r in rows] == ["z0_mbs8_gas1", "z0_mbs2_gas1"]
    assert all(r["status"] == "ok" and r["metrics"]["throughput"] > 0 for r in rows), rows
    for micro in (8, 2):
        out = (tmp_path / "autotuning_exps" / f"z0_mbs{micro}_gas1" / "stdout.log").read_text()
        assert f"hf batch {micro} accum 1" in out, out[-2000:]
    best = max(rows, key=lambda r: r["metrics"]["throughput"])["name"]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert best == f"z0_mbs{optimal['train_micro_batch_size_per_gpu']}_gas1"
    command = (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text()
    assert f"--per_device_train_batch_size {optimal['train_micro_batch_size_per_gpu']}" in command
