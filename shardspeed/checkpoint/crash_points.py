"""Test-only fault injection at the points of a checkpoint save (off unless its variables are set).

Every write of a checkpoint file's bytes, every fsync and rename and each step of committing a tag
calls :func:`reached` with a label. With ``SHARDSPEED_CHECKPOINT_KILL_AT=k`` in its environment a
process kills itself (SIGKILL: no cleanup, no ``finally``) at the k-th point it reaches; with
``SHARDSPEED_CHECKPOINT_FAIL_AT=k`` it raises ``OSError`` there instead (a failed write);
``SHARDSPEED_CHECKPOINT_DELAY_S=s`` sleeps ``s`` seconds at every point (a slow disk);
``SHARDSPEED_CHECKPOINT_EVENTS=<file>`` appends ``"<k> <label>"`` for every point to a file, so a
test can choose the points to kill at. Points are counted from the first one reached with any of
these set, or from :func:`reset`. Used by tests/checkpoint/test_crash_safety.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time

KILL_AT = "SHARDSPEED_CHECKPOINT_KILL_AT"
FAIL_AT = "SHARDSPEED_CHECKPOINT_FAIL_AT"
EVENTS = "SHARDSPEED_CHECKPOINT_EVENTS"
DELAY_S = "SHARDSPEED_CHECKPOINT_DELAY_S"

_lock = threading.Lock()
_count = 0


def reset() -> None:
    """Count points from zero again."""
    global _count
    with _lock:
        _count = 0


def reached(label: str) -> None:
    """A save reached the point ``label``: kill, fail or record here if the environment says so."""
    global _count
    kill_at, fail_at, events, delay = (
        os.environ.get(k) for k in (KILL_AT, FAIL_AT, EVENTS, DELAY_S)
    )
    if kill_at is None and fail_at is None and events is None and delay is None:
        return
    if delay is not None:
        time.sleep(float(delay))
    with _lock:
        _count += 1
        count = _count
    if events:
        with open(events, "a") as log:
            log.write(f"{count} {label}\n")
    if kill_at is not None and count == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)
    if fail_at is not None and count == int(fail_at):
        raise OSError(f"injected checkpoint write failure at point {count} ({label})")
