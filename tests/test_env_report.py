"""``shardspeed-report``: the JSON parses and lists every field; the table and warnings render."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardspeed import env_report

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report_json() -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "shardspeed.env_report", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
        check=True,
    )
    return json.loads(out.stdout)


def test_json_lists_fields(report_json: dict) -> None:
    r = report_json
    assert list(r) == [
        "shardspeed",
        "deepspeed_import",
        "python",
        "torch",
        "accelerator",
        "comm_backends",
        "native_ops",
        "shm",
        "nvme",
        "monitors",
        "launchers",
        "warnings",
    ]
    assert {"version", "git_hash", "git_branch", "install_path"} <= set(r["shardspeed"])
    assert r["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    import torch

    assert r["torch"]["version"] == torch.__version__
    assert {"cuda_version", "nccl_version", "hip_version", "cudnn_version"} <= set(r["torch"])
    acc = r["accelerator"]
    assert acc["name"] in {"cpu", "cuda", "mps"}
    assert acc["device_count"] == len(acc["devices"]) >= 1
    assert all("total_memory_bytes" in d for d in acc["devices"])
    assert r["comm_backends"]["gloo"] is True
    assert r["native_ops"]["required"] is False
    assert r["shm"]["path"] == "/dev/shm" and "size_bytes" in r["shm"]
    assert {"o_direct", "filesystem", "device", "path", "detail"} <= set(r["nvme"])
    assert r["nvme"]["path"] == str(REPO)
    assert set(r["monitors"]) == {"tensorboard", "wandb", "comet_ml"}
    assert all(set(m) == {"installed", "version"} for m in r["monitors"].values())
    assert set(r["launchers"]) == {"pdsh", "mpirun", "srun", "ssh"}
    assert isinstance(r["warnings"], list)


def test_shm_warning(tmp_path: Path, monkeypatch) -> None:
    class Small:
        f_blocks, f_frsize, f_bavail = 64, 1024 * 1024, 60  # 64 MiB

    monkeypatch.setattr(env_report.os, "statvfs", lambda path: Small())
    info = env_report.shm_info()
    assert info["size_bytes"] == 64 * 1024**2
    assert info["warning"] == (
        "/dev/shm is only 64 MiB; data loader workers and NCCL's shared-memory transport may "
        "fail. If running in docker increase to at least --shm-size='1gb'"
    )

    class Big(Small):
        f_blocks = 1024

    monkeypatch.setattr(env_report.os, "statvfs", lambda path: Big())
    assert env_report.shm_info()["warning"] is None


def test_o_direct_probe(tmp_path: Path) -> None:
    info = env_report.nvme_info(str(tmp_path))
    assert info["path"] == str(tmp_path)
    assert isinstance(info["o_direct"], bool)
    assert list(tmp_path.iterdir()) == []  # the probe file is removed
    missing = env_report.nvme_info(str(tmp_path / "missing"))
    assert missing["o_direct"] is False and "cannot create a file here" in missing["detail"]


def test_broken_probe_becomes_an_error_entry(monkeypatch) -> None:
    def boom() -> dict:
        raise RuntimeError("no driver")

    monkeypatch.setattr(env_report, "accelerator_info", boom)
    report = env_report.collect_report()
    assert report["accelerator"] == {"error": "RuntimeError: no driver"}
    assert "accelerator: RuntimeError: no driver" in report["warnings"]
    assert "error" in env_report.format_report(report)


def test_table_and_flags(capsys) -> None:
    assert env_report.cli_main([]) == 0
    text = capsys.readouterr().out
    for heading in (
        "[shardspeed]",
        "[torch]",
        "[accelerator]",
        "[comm backends]",
        "[native ops]",
        "[/dev/shm]",
        "[nvme / O_DIRECT]",
        "[monitors]",
        "[warnings]",
    ):
        assert heading in text
    assert env_report.cli_main(["--hide_operator_status", "--hide_errors_and_warnings"]) == 0
    text = capsys.readouterr().out
    assert "[native ops]" not in text and "[warnings]" not in text
    assert env_report.cli_main(["--json", "--hide_operator_status"]) == 0
    assert "native_ops" not in json.loads(capsys.readouterr().out)


def test_console_script_exists() -> None:
    import shutil

    path = shutil.which("shardspeed-report")
    if path is None:
        pytest.skip("console scripts not installed (pip install -e .)")
    out = subprocess.run([path, "--json"], capture_output=True, text=True, timeout=60, check=True)
    assert "shardspeed" in json.loads(out.stdout)
