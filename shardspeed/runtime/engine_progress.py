"""A progress display for long training runs, on global rank 0.

Off by default in non-interactive runs. ``SHARDSPEED_PROGRESS=1`` turns it on, ``=0`` off; unset,
it is on only when stderr is a terminal. In a terminal it is a tqdm bar redrawn in place; written
to a file or pipe (where carriage-return redraws would turn into garbage) it is a plain log line
every ``SHARDSPEED_PROGRESS_INTERVAL`` seconds (default 30), formatted like the bar.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from shardspeed.utils.logging import logger

__all__ = ["ProgressDisplay", "progress_requested"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def progress_requested(stream: Any = None) -> bool:
    """Whether the environment asks for a progress display (see the module docstring)."""
    value = os.environ.get("SHARDSPEED_PROGRESS", "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE or value:
        return False
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


class ProgressDisplay:
    """Shows optimizer steps, samples/s and the latest loss."""

    def __init__(self, enabled: bool, total: int | None = None, stream: Any = None) -> None:
        self.enabled = enabled
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = float(os.environ.get("SHARDSPEED_PROGRESS_INTERVAL", "30"))
        self._bar: Any = None
        self._started = time.monotonic()
        self._last_line = float("-inf")
        if enabled and self.interactive:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, unit="step", desc="train", file=self.stream, dynamic_ncols=True
            )

    def update(self, step: int, loss: float | None = None, samples_per_sec: float = 0.0) -> None:
        """Record that optimizer step ``step`` finished."""
        if not self.enabled:
            return
        postfix = {}
        if loss is not None:
            postfix["loss"] = f"{loss:.4f}"
        if samples_per_sec:
            postfix["samples/s"] = f"{samples_per_sec:.1f}"
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        now = time.monotonic()
        if now - self._last_line < self.interval and step != self.total:
            return
        self._last_line = now
        from tqdm import tqdm

        extra = ", ".join(f"{k}={v}" for k, v in postfix.items())
        meter = tqdm.format_meter(
            step, self.total, now - self._started, unit="step", prefix="train"
        )
        logger.info(f"{meter}{' ' + extra if extra else ''}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
