"""One error from N ranks is told once, naming the ranks; tracebacks go to per-rank logs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardspeed.launcher.rank_errors import TracebackFilter, errors_in_file, failure_report

from .conftest import SCRIPTS, free_port, run_shardspeed

CONFIG_ERROR = str(SCRIPTS / "config_error.py")
MESSAGE = "Unknown key 'zero_optimisation'; did you mean 'zero_optimization'?"

TRACEBACK = b"""Traceback (most recent call last):
  File "train.py", line 3, in <module>
    main()
    ^^^^^^
ValueError: first

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "train.py", line 5, in <module>
shardspeed.config.errors.DeepSpeedConfigError: second
"""


def _shown(chunks: list[bytes]) -> tuple[bytes, TracebackFilter]:
    found = TracebackFilter()
    shown = b"".join(found.feed(chunk) for chunk in chunks) + found.close()
    return shown, found


def test_filter_leaves_out_tracebacks_and_keeps_their_last_lines() -> None:
    shown, found = _shown([b"step 1\n", TRACEBACK, b"after\n"])
    assert shown == b"step 1\nafter\n"
    assert found.errors == [
        "ValueError: first",
        "shardspeed.config.errors.DeepSpeedConfigError: second",
    ]


def test_filter_reads_torch_rank_prefixes_and_split_chunks() -> None:
    prefixed = b"".join(b"[rank1]: " + line + b"\n" for line in TRACEBACK.splitlines())
    data = b"loss 1.0\n" + prefixed + b"progress 50%\r"
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]  # lines cut anywhere
    shown, found = _shown(chunks)
    assert shown == b"loss 1.0\nprogress 50%\r"
    assert found.errors[-1] == "shardspeed.config.errors.DeepSpeedConfigError: second"
    # a partial line that cannot open a traceback is shown before its newline
    assert TracebackFilter().feed(b"50%|####  ") == b"50%|####  "


def test_report_groups_ranks_by_error(tmp_path: Path) -> None:
    log = tmp_path / "rank2.log"
    log.write_bytes(TRACEBACK)
    assert errors_in_file(log)[-1].endswith("DeepSpeedConfigError: second")
    report = failure_report(
        [(0, ["E: same"], None), (1, ["E: same"], None), (2, errors_in_file(log), log)]
    )
    assert report.splitlines() == [
        "ranks 0, 1 failed: E: same",
        "rank 2 failed: shardspeed.config.errors.DeepSpeedConfigError: second",
        f"full output with tracebacks: rank2.log in {tmp_path}",
    ]


@pytest.mark.timeout(90)
def test_config_error_on_every_rank_is_told_once() -> None:
    result = run_shardspeed(
        "--num_gpus", "2", "--master_port", str(free_port()), CONFIG_ERROR, timeout=80
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "rank 0 is up" in output and "rank 1 is up" in output  # ordinary output still shows
    assert "Traceback" not in output
    assert output.count(MESSAGE) == 1, output
    assert f"ranks 0, 1 failed: shardspeed.config.errors.DeepSpeedConfigError: {MESSAGE}" in output
    match = re.search(r"full output with tracebacks: rank\d.log, rank\d.log in (\S+)", output)
    assert match, output
    for rank in (0, 1):
        log = (Path(match.group(1)) / f"rank{rank}.log").read_text()
        assert "Traceback (most recent call last)" in log and MESSAGE in log


@pytest.mark.timeout(90)
def test_a_handled_traceback_is_kept_in_a_log_and_named() -> None:
    result = run_shardspeed(
        "--num_gpus", "2", "--master_port", str(free_port()), CONFIG_ERROR, "--ok", timeout=80
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    assert "ranks 0, 1 printed a traceback and went on: KeyError: 'handled'" in output
    assert "full output with tracebacks: rank" in output


@pytest.mark.timeout(90)
def test_with_each_rank_log_the_error_is_read_from_the_logs(tmp_path: Path) -> None:
    result = run_shardspeed(
        "--num_gpus", "2", "--master_port", str(free_port()),
        "--enable_each_rank_log", str(tmp_path), CONFIG_ERROR, timeout=80,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output and output.count(MESSAGE) == 1, output
    assert f"ranks 0, 1 failed: shardspeed.config.errors.DeepSpeedConfigError: {MESSAGE}" in output
    logs = sorted(tmp_path.glob("*_rank*.log"))
    assert len(logs) == 2 and all("Traceback" in p.read_text() for p in logs)
    assert f"in {tmp_path}" in output
