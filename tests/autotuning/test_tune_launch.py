"""``shardspeed --autotuning tune|run`` end to end: real launches of the example GPT on 2 CPU
ranks (each experiment is a full launch, so this file takes a few minutes on a busy machine)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardspeed.autotuning.autotuner import Autotuner, AutotuningError
from shardspeed.autotuning.fit import GB, ModelInfo, memory_needed
from shardspeed.autotuning.space import Point
from shardspeed.launcher import runner

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "train_gpt.py")
SCRIPT_ARGS = ["--n_layer", "1", "--n_embd", "32", "--steps", "10"]


def write_config(folder: Path, **autotuning: Any) -> Path:
    """A fixed global batch of 32 on 2 ranks; ZeRO 0 or 3; micro-batch 1, 4 or 16."""
    config = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [0, 3]},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 2,
            "end_profile_step": 8,
            "num_tuning_micro_batch_sizes": 3,
            "tuner_early_stopping": 0,
            "model_info_path": str(folder.parent / "model_info.json"),
            **autotuning,
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.json"
    path.write_text(json.dumps(config))
    return path


def launch(folder: Path, mode: str, cfg: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardspeed.launcher.runner", "--autotuning", mode]
    cmd += ["--num_gpus", "2", EXAMPLE, "--deepspeed_config", str(cfg), *SCRIPT_ARGS, *extra]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def results(folder: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(
        (folder / "autotuning_results" / "results.json").read_text()
    )
    return rows


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("autotune")


@pytest.mark.timeout(900)
def test_model_based_tune_matches_the_exhaustive_grid(work: Path) -> None:
    grid_dir = work / "grid"
    cfg = write_config(grid_dir, tuner_type="gridsearch")
    done = launch(grid_dir, "tune", cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    grid = {r["name"]: r["metrics"]["throughput"] for r in results(grid_dir) if r["status"] == "ok"}
    assert len(grid) == 6, results(grid_dir)  # 2 stages x 3 micro-batches, all measured
    assert (work / "model_info.json").is_file()  # profiled once, reused below

    # the model-based tune resumes from the grid's experiments (overwrite off): it decides on the
    # very measurements the grid made, so the 5% comparison is about the search, not about noise
    # between two launches of one point on a busy machine (and it launches nothing new)
    tune_dir = work / "tune"
    cfg = write_config(
        tune_dir,
        tuner_type="model_based",
        tuner_num_trials=len(grid) // 3,
        overwrite=False,
        exps_dir=str(grid_dir / "autotuning_exps"),
    )
    done = launch(tune_dir, "tune", cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = results(tune_dir)
    assert 1 <= len(trials) <= len(grid) // 3 and all(r["resumed"] for r in trials)
    optimal = json.loads((tune_dir / "autotuning_results" / "ds_config_optimal.json").read_text())
    chosen = Point(
        optimal["zero_optimization"]["stage"],
        optimal["train_micro_batch_size_per_gpu"],
        optimal["gradient_accumulation_steps"],
    ).name
    assert optimal["autotuning"]["enabled"] is False and "metric_path" not in optimal["autotuning"]
    assert grid[chosen] >= 0.95 * max(grid.values()), (chosen, grid)
    summary = (tune_dir / "autotuning_results" / "summary.txt").read_text()
    assert chosen in summary and "optimal: " + chosen in summary


@pytest.mark.timeout(600)
def test_run_prunes_what_does_not_fit_and_launches_the_job_with_the_choice(work: Path) -> None:
    info = ModelInfo.from_dict(json.loads((work / "model_info.json").read_text()))
    biggest = memory_needed(Point(0, 16, 1), info, 2, mixed=False)
    rest = max(
        memory_needed(Point(s, m, 32 // 2 // m), info, 2, False)
        for s in (0, 3)
        for m in (1, 4, 16)
        if (s, m) != (0, 16)
    )
    limit_gb = (biggest + rest) / 2 / GB  # only ZeRO-0 at micro-batch 16 does not fit
    run_dir = work / "run"
    cfg = write_config(
        run_dir, tuner_type="model_based", tuner_num_trials=1, memory_limit_gb=limit_gb
    )
    done = launch(run_dir, "run", cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    space = json.loads((run_dir / "autotuning_results" / "space.json").read_text())
    unfit = {p["name"] for p in space["points"] if not p["fits"]}
    assert unfit == {"z0_mbs16_gas1"}
    launched = set(os.listdir(run_dir / "autotuning_exps"))
    assert launched and not launched & unfit
    assert "profile_model_info" not in launched  # the model info cached by the grid's tune
    # the prior picks the largest micro-batch that fits: ZeRO-3 at 16; the job sees it
    assert [r["name"] for r in results(run_dir)] == ["z3_mbs16_gas1"]
    assert "micro-batch 16, accumulation 1, ZeRO stage 3" in done.stdout, done.stdout[-2000:]
    assert "done: 10 steps" in done.stdout

    # a resumed tune (overwrite off) reuses the recorded experiment instead of launching it
    at = json.loads(cfg.read_text())
    at["autotuning"]["overwrite"] = False
    cfg.write_text(json.dumps(at))
    args = runner.parse_args(["--num_gpus", "2", EXAMPLE, "--deepspeed_config", str(cfg)])
    cwd = os.getcwd()
    os.chdir(run_dir)
    try:
        tuner = Autotuner(args, {"localhost": [0, 1]})
        assert tuner.tune().name == "z3_mbs16_gas1"
    finally:
        os.chdir(cwd)
    assert [r["resumed"] for r in tuner.records] == [True]


def test_impossible_memory_limit_ends_with_a_clear_message(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, memory_limit_gb=1e-6, model_info={"num_params": 120_000}, model_info_path=None
    )
    cfg_data = json.loads(cfg.read_text())
    del cfg_data["autotuning"]["model_info_path"]
    cfg.write_text(json.dumps(cfg_data))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        argv = ["--autotuning", "tune", "--num_gpus", "2", EXAMPLE, "--deepspeed_config", str(cfg)]
        with pytest.raises(AutotuningError, match="no configuration fits in 0.000 GiB per rank"):
            runner.main(argv)
        assert runner.cli(argv) == 2  # the console command: one error line, exit code 2
    finally:
        os.chdir(cwd)
    assert os.listdir(tmp_path / "autotuning_exps") == []  # nothing was launched
    assert isinstance(AutotuningError("x"), AssertionError)


def test_a_script_without_a_config_file_is_refused() -> None:
    args = argparse.Namespace(user_args=["--steps", "3"], user_script="s.py")
    with pytest.raises(ValueError, match="--deepspeed_config cfg.json"):
        Autotuner(args, {"localhost": [0, 1]})


def test_overwrite_never_empties_the_working_directory(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, exps_dir=".", model_info={"num_params": 10})
    args = runner.parse_args(["--num_gpus", "2", EXAMPLE, "--deepspeed_config", str(cfg)])
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(AutotuningError, match="would delete '.'"):
            Autotuner(args, {"localhost": [0, 1]})
    finally:
        os.chdir(cwd)
    assert cfg.is_file()
