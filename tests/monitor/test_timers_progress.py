"""Timers, the throughput meter and the progress display."""

from __future__ import annotations

import io
import logging
import time

from shardspeed.runtime.engine_progress import ProgressDisplay, progress_requested
from shardspeed.utils.logging import logger
from shardspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer, ThroughputTimer


def test_named_timers_accumulate_and_reset() -> None:
    timers = SynchronizedWallClockTimer()
    for _ in range(2):
        timers("fwd").start()
        time.sleep(0.01)
        timers("fwd").stop()
    elapsed = timers("fwd").elapsed(reset=True)
    assert 15 < elapsed < 500
    assert timers("fwd").elapsed() == 0.0
    assert timers.log(["fwd"]).startswith("time (ms) | fwd:")
    disabled = SynchronizedWallClockTimer(enabled=False)
    assert isinstance(disabled("fwd"), NoopTimer) and disabled.timers == {}


def test_throughput_samples_tokens_flops() -> None:
    lines: list[str] = []
    tput = ThroughputTimer(batch_size=8, start_step=1, steps_per_output=2, logging_fn=lines.append)
    tput.tokens_per_sample, tput.flops_per_sample = 16, 1e9
    for _ in range(3):
        tput.start()
        time.sleep(0.01)
        tput.stop(global_step=True)
    rate = tput.avg_samples_per_sec()
    assert 0 < rate < 8 / 0.01
    assert tput.avg_tokens_per_sec() == rate * 16
    assert tput.avg_tflops_per_sec() == rate * 1e9 / 1e12
    assert len(lines) == 1 and "tokens/sec=" in lines[0] and "TFLOP/s" in lines[0]


def test_progress_off_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("SHARDSPEED_PROGRESS", raising=False)
    assert not progress_requested(io.StringIO())  # not a terminal
    monkeypatch.setenv("SHARDSPEED_PROGRESS", "1")
    assert progress_requested(io.StringIO())
    monkeypatch.setenv("SHARDSPEED_PROGRESS", "0")
    assert not progress_requested(io.StringIO())


def test_progress_in_a_log_file_is_plain_lines(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSPEED_PROGRESS_INTERVAL", "0")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        display = ProgressDisplay(enabled=True, total=3, stream=io.StringIO())
        for step in (1, 2, 3):
            display.update(step, loss=1.5, samples_per_sec=10.0)
        display.close()
    finally:
        logger.removeHandler(handler)
    assert len(records) == 3 and all("\r" not in r for r in records)
    assert records[-1].startswith("train: 100%") and "loss=1.5000" in records[-1]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_terminal_is_a_bar() -> None:
    stream = _Tty()
    display = ProgressDisplay(enabled=True, total=2, stream=stream)
    display.update(1, loss=2.0)
    display.update(2, loss=1.0)
    display.close()
    assert "2/2" in stream.getvalue() and "\r" in stream.getvalue()
