"""``shardspeed --autotuning tune`` on a Hugging Face ``Trainer`` script (2 CPU ranks), one tune
shared by every assertion (each experiment is a full launch): the micro-batch reaches the script
through ``arg_mappings`` and agrees with the config's ``"auto"`` values the Trainer fills in (it
refuses a mismatch); the AutoTP size ``[1, 2]`` is a layout axis the script gets in its config;
activation checkpointing (``"auto"``) reaches it as ``--gradient_checkpointing`` when on; each
trial is measured by the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf.conftest import SCRIPTS, free_port, rank_env


@pytest.mark.timeout(800)
def test_trainer_script_is_tuned_through_arg_mappings(compat_site: Path, tmp_path: Path) -> None:
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": [1, 2]},
        "autotuning": {
            "enabled": True,
            "tuner_type": "model_based",
            "tuner_num_trials": 3,
            "tuner_early_stopping": 0,
            "start_profile_step": 1,
            "end_profile_step": 3,
            # one micro-batch, 4, which must replace the script's 2 through arg_mappings
            "min_train_micro_batch_size_per_gpu": 4,
            "max_train_micro_batch_size_per_gpu": 4,
            "activation_checkpointing": "auto",
            "arg_mappings": {
                "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                "gradient_accumulation_steps": "--gradient_accumulation_steps",
                "autotuning.activation_checkpointing": "--gradient_checkpointing",
            },
        },
    }
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "shardspeed.launcher.runner", "--autotuning", "tune",
           "--num_gpus", "2", "--master_port", str(free_port()),
           str(SCRIPTS / "autotune_trainer.py"), "--deepspeed", str(cfg),
           "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2",
           "--max_steps", "6"]  # fmt: skip
    done = subprocess.run(
        cmd, env=rank_env(compat_site), cwd=tmp_path, capture_output=True, text=True, timeout=760
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "autotuning_results" / "results.json").read_text())
    # the prior's first pick, then one trial per axis the model has not seen: the layout (TP 2),
    # then checkpointing
    expected = {
        "z0_tp1_sp1_mbs4_gas1_nockpt": "hf batch 4 accum 1 checkpointing False autotp 1",
        "z0_tp2_sp1_mbs4_gas1_nockpt": "hf batch 4 accum 1 checkpointing False autotp 2",
        "z0_tp1_sp1_mbs4_gas1_ckpt": "hf batch 4 accum 1 checkpointing True autotp 1",
    }
    assert [r["name"] for r in rows] == list(expected)
    assert all(r["status"] == "ok" and r["metrics"]["throughput"] > 0 for r in rows), rows
    for name, seen in expected.items():
        out = (tmp_path / "autotuning_exps" / name / "stdout.log").read_text()
        assert seen in out, out[-2000:]
    # the profile ran at the data-parallel layout without checkpointing, so its figures are the
    # whole model's
    profile = json.loads((tmp_path / "autotuning_exps" / "profile_model_info" / "ds_config.json")
                         .read_text())  # fmt: skip
    assert profile["tensor_parallel"]["autotp_size"] == 1
    assert profile["autotuning"]["activation_checkpointing"] is False
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert all(name in summary for name in expected)  # the table names both layouts
    best = max(rows, key=lambda r: r["metrics"]["throughput"])["name"]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    micro = optimal["train_micro_batch_size_per_gpu"]
    tp = optimal["tensor_parallel"]["autotp_size"]
    ckpt = optimal["autotuning"]["activation_checkpointing"]
    assert best == f"z0_tp{tp}_sp1_mbs{micro}_gas1_{'ckpt' if ckpt else 'nockpt'}"
    command = (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text()
    assert f"--per_device_train_batch_size {micro}" in command
    assert ("--gradient_checkpointing" in command) == ckpt
