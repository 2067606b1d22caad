"""Monitor backends built directly, as DeepSpeed's tests build them on every rank: a disabled
one creates nothing, an enabled one creates its folder on global rank 0 only, and each exposes
DeepSpeed's attributes (``output_path``/``job_name``; W&B's ``group``/``team``/``project``)."""

from __future__ import annotations

import os

import pytest

from shardspeed.config.monitor import CSVConfig, DeepSpeedMonitorConfig, TensorBoardConfig
from shardspeed.monitor.comet import CometMonitor
from shardspeed.monitor.csv_monitor import csvMonitor
from shardspeed.monitor.tensorboard import TensorBoardMonitor
from shardspeed.monitor.wandb import WandbMonitor
from shardspeed.runtime.config import DeepSpeedConfig


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_disabled_monitors_create_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    sections = DeepSpeedMonitorConfig()
    csv = csvMonitor(sections.csv_monitor)
    tensorboard = TensorBoardMonitor(sections.tensorboard)
    wandb = WandbMonitor(sections.wandb)  # no wandb run (nor the package) is needed
    comet = CometMonitor(sections.comet)
    for monitor in (csv, tensorboard, wandb, comet):
        assert not monitor.enabled
        monitor.write_events([("Train/loss", 1.0, 1)])
        monitor.close()
    assert _listing(tmp_path) == []  # neither csv_monitor/ nor runs/
    assert (csv.output_path, csv.job_name) == ("", "DeepSpeedJobName")
    assert (tensorboard.output_path, tensorboard.job_name) == ("", "DeepSpeedJobName")
    assert (wandb.group, wandb.team, wandb.project) == (None, None, "deepspeed")
    assert wandb.run is None and tensorboard.summary_writer is None and csv.log_dir is None


@pytest.mark.parametrize("rank", ["0", "1"])
def test_enabled_monitors_write_from_rank_zero_only(tmp_path, monkeypatch, rank) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", rank)
    config = DeepSpeedConfig(
        {
            "train_batch_size": 2,
            "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "test"},
            "tensorboard": {"enabled": True, "job_name": "tb"},
        },
        dp_world_size=1,
    )
    csv = csvMonitor(config.monitor_config.csv_monitor)
    # older DeepSpeed releases handed the whole monitor config to the backend
    whole = csvMonitor(config.monitor_config)
    assert csv.enabled and whole.enabled
    assert (csv.output_path, csv.job_name) == ("logs/", "test")
    assert (whole.output_path, whole.job_name) == ("logs/", "test")
    csv.write_events([("Train/Samples/loss", 0.5, 4)])
    tensorboard = TensorBoardMonitor(TensorBoardConfig(enabled=True, job_name="tb"))
    assert (tensorboard.output_path, tensorboard.job_name) == ("", "tb")
    tensorboard.write_events([("Train/Samples/loss", 0.5, 4)])
    tensorboard.close()
    if rank == "1":
        assert _listing(tmp_path) == []
        return
    assert _listing(tmp_path / "logs" / "test") == ["Train_Samples_loss.csv"]
    assert _listing(tmp_path) == ["logs", "runs"]
    assert _listing(tmp_path / "runs") == ["tb"] and _listing(tmp_path / "runs" / "tb")


def test_csv_section_object(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monitor = csvMonitor(CSVConfig(enabled=True, output_path=str(tmp_path), job_name="j"))
    assert monitor.log_dir == str(tmp_path / "j") and os.path.isdir(monitor.log_dir)
