"""shardspeed-io: the sweep runs, checks the data it read back, and names the best aio section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardspeed.config.aio import AioConfig
from shardspeed.runtime.swap.io_bench import main, run


def test_sweep_reports_dd_swapper_and_best_aio(tmp_path: Path) -> None:
    result = run(
        str(tmp_path),
        size_mb=1,
        block_sizes=[65_536],
        queue_depths=[1, 2],
        threads=[1, 2],
        repeats=1,
    )
    assert len(result["swapper"]) == 4
    assert all(row["write"]["gbps"] > 0 and row["read"]["gbps"] > 0 for row in result["swapper"])
    AioConfig(**result["best_aio"])  # pastes into a config as is
    if result["o_direct"]:
        assert result["dd"] and result["best"]["read_vs_dd"] > 0
        assert set(result["per_block_size"]) == {"65536"}
    assert list(tmp_path.iterdir()) == []  # no files left behind


def test_command_prints_one_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--folder",
        str(tmp_path),
        "--size-mb",
        "1",
        "--block-sizes",
        "64k",
        "--queue-depths",
        "1",
    ]
    assert main([*argv, "--threads", "1", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["best_aio"]["block_size"] == 65_536
