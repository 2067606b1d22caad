"""Monitor backends in one process: CSV files, W&B offline history, Comet offline archive,
rank filtering and the error for a missing package."""

from __future__ import annotations

import csv
import glob
import json
import os
import sys
import time
import zipfile

import pytest

from shardspeed.config.monitor import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from shardspeed.monitor import MonitorMaster
from tests.monitor.wandb_reader import history_rows

EVENTS = [
    [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 0.1, 8)],
    [("Train/Samples/train_loss", 2.0, 16), ("Train/Samples/lr", 0.05, 16)],
]


def _write(master: MonitorMaster) -> None:
    for events in EVENTS:
        master.write_events(events)
    master.close()


def test_csv_one_file_per_event(tmp_path) -> None:
    cfg = DeepSpeedMonitorConfig(
        csv_monitor=CSVConfig(enabled=True, output_path=str(tmp_path), job_name="job")
    )
    _write(MonitorMaster(cfg))
    with open(tmp_path / "job" / "Train_Samples_train_loss.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows == [["step", "Train/Samples/train_loss"], ["8", "2.5"], ["16", "2.0"]]
    assert sorted(os.listdir(tmp_path / "job")) == [
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]


def test_only_rank0_writes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    cfg = DeepSpeedMonitorConfig(csv_monitor=CSVConfig(enabled=True, output_path=str(tmp_path)))
    master = MonitorMaster(cfg)
    assert master.enabled and master.backends == []
    _write(master)
    assert os.listdir(tmp_path) == []


def test_missing_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match=r"pip install shardspeed\[wandb\]"):
        MonitorMaster(DeepSpeedMonitorConfig(wandb=WandbConfig(enabled=True)))


def test_tensorboard_missing_package(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"shardspeed\[tensorboard\]"):
        MonitorMaster(DeepSpeedMonitorConfig(tensorboard=TensorBoardConfig(enabled=True)))


def test_wandb_offline_history(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install shardspeed[wandb])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    _write(MonitorMaster(DeepSpeedMonitorConfig(wandb=WandbConfig(enabled=True, project="t"))))
    # wandb's service process writes the offline file; under load it can still be flushing
    # when finish() returns, so read until the rows appear (bounded)
    deadline = time.monotonic() + 15
    rows: list = []
    while not rows and time.monotonic() < deadline:
        files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
        rows = history_rows(files[0]) if len(files) == 1 else []
        if not rows:
            time.sleep(0.2)
    assert [(r["_step"], r["Train/Samples/train_loss"], r["Train/Samples/lr"]) for r in rows] == [
        (8, 2.5, 0.1),
        (16, 2.0, 0.05),
    ]


def test_comet_offline_archive(tmp_path, monkeypatch) -> None:
    pytest.importorskip(
        "comet_ml", reason="comet_ml is not installed (pip install shardspeed[comet])"
    )
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    cfg = CometConfig(enabled=True, online=False, project="t", samples_log_interval=8)
    _write(MonitorMaster(DeepSpeedMonitorConfig(comet=cfg)))
    (archive,) = glob.glob(str(tmp_path / "*.zip"))
    with zipfile.ZipFile(archive) as zipped:
        text = "\n".join(
            zipped.read(name).decode("utf-8", "replace")
            for name in zipped.namelist()
            if name.endswith(".json")
        )
    metrics = [
        json.loads(line)["payload"]["metric"]
        for line in text.splitlines()
        if line.startswith("{") and '"metric"' in line and '"metricName"' in line
    ]
    logged = {(m["metricName"], m["step"], float(m["metricValue"])) for m in metrics}
    assert ("Train/Samples/train_loss", 8, 2.5) in logged
    assert ("Train/Samples/lr", 16, 0.05) in logged
