"""Watching a node's ranks: the first failure tears the node's job down, and signals are forwarded.

Every rank runs in its own session (process group), so tearing down also reaches the processes a
rank started (data loader workers, compilers). Ranks also ask the kernel for ``SIGTERM`` when the
node launcher dies, so even ``kill -9`` of the launcher leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shardspeed.launcher.constants import FAILURE_GRACE_S, TERMINATE_GRACE_S
from shardspeed.launcher.rank_errors import (
    RankStderr,
    errors_in_file,
    failure_report,
    log_folder,
)
from shardspeed.utils.logging import logger

POLL_INTERVAL_S = 0.05
_PR_SET_PDEATHSIG = 1
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class RankProcess:
    """One spawned rank and what the supervisor needs to report on it."""

    rank: int
    local_rank: int
    popen: subprocess.Popen[bytes]
    log_file: IO[bytes] | None = None
    #: the pump of its stderr when it has no log file
    stderr: RankStderr | None = None

    def describe(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.popen.pid})"

    def errors(self) -> list[str]:
        """The final lines of the Python tracebacks this rank printed."""
        if self.stderr is not None:
            return self.stderr.filter.errors
        if self.log_file is not None:
            return errors_in_file(self.log_file.name)
        return []


@dataclass
class StopRequest:
    """The signal the node launcher received, if any (set from the signal handler)."""

    signum: int | None = None


def child_setup(cores: list[int] | None) -> Callable[[], None]:
    """A ``preexec_fn``: die with the parent, and pin to ``cores`` when given."""
    parent = os.getpid()
    libc = _libc()

    def setup() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # the parent may have died between fork and prctl; then nobody would signal us
        if os.getppid() != parent:
            os._exit(1)
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def signal_group(proc: RankProcess, sig: int) -> None:
    """Send ``sig`` to the rank's whole process group; a group that is gone is fine."""
    try:
        os.killpg(proc.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(ranks: list[RankProcess], sig: int = signal.SIGTERM) -> None:
    """``sig`` to every rank's group, ``SIGKILL`` after the grace period, then reap them all."""
    for proc in ranks:
        signal_group(proc, sig)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    while time.monotonic() < deadline and any(p.popen.poll() is None for p in ranks):
        time.sleep(POLL_INTERVAL_S / 2)
    for proc in ranks:
        # also reaches what a finished rank left behind in its group
        signal_group(proc, signal.SIGKILL)
        proc.popen.wait()
        if proc.log_file is not None:
            proc.log_file.close()
        if proc.stderr is not None:
            proc.stderr.finish()


def exit_code_of(returncode: int) -> int:
    """The shell convention: a rank killed by signal N gives 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def supervise(ranks: list[RankProcess], stop: StopRequest) -> int:
    """Wait for the ranks; return 0 when all succeed, else the failing rank's exit code.

    On the first failure the others get a moment to stop by themselves (a config error fails
    every rank at once), then are terminated; the Python errors of the failed
    ranks are reported once (:func:`report_errors`). On a forwarded signal all ranks get it and
    the result is 128 + the signal number.
    """
    pending = list(ranks)
    while pending:
        if stop.signum is not None:
            name = signal.Signals(stop.signum).name
            logger.info(f"received {name}; forwarding it to {len(ranks)} local rank(s)")
            terminate(ranks, stop.signum)
            return 128 + stop.signum
        for proc in list(pending):
            code = proc.popen.poll()
            if code is None:
                continue
            pending.remove(proc)
            if code != 0:
                logger.error(
                    f"{proc.describe()} {_describe_exit(code)}; terminating the other "
                    f"{len(pending)} running local rank(s) and exiting with code "
                    f"{exit_code_of(code)}"
                )
                _await_others(pending)
                terminate(ranks)
                # the others that failed by themselves or had begun to raise
                failed = [
                    proc,
                    *(p for p in pending if (p.popen.returncode or 0) > 0 or p.errors()),
                ]
                report_errors(ranks, failed)
                return exit_code_of(code)
        if pending:
            time.sleep(POLL_INTERVAL_S)
    terminate(ranks)
    report_errors(ranks, [])
    return 0


def _await_others(pending: list[RankProcess]) -> None:
    """Give the ranks of ``pending`` ``FAILURE_GRACE_S`` to exit by themselves."""
    deadline = time.monotonic() + FAILURE_GRACE_S
    while time.monotonic() < deadline and any(p.popen.poll() is None for p in pending):
        time.sleep(POLL_INTERVAL_S)


def report_errors(ranks: list[RankProcess], failed: list[RankProcess]) -> None:
    """Tell each distinct Python error once, naming its ranks: the failed ranks' (as an error)
    and, apart, those of ranks that printed a traceback and went on (as a warning). The full
    output is in the per-rank logs (written now for ranks whose stderr came through a pipe)."""
    folder = None
    others = [p for p in ranks if p not in failed]
    for procs, verb in ((failed, "failed"), (others, "printed a traceback and went on")):
        entries = []
        for proc in procs:
            errors = proc.errors()
            if procs is others and not errors:
                continue
            path = None
            if proc.log_file is not None:
                path = Path(proc.log_file.name)
            elif proc.stderr is not None:
                folder = folder or log_folder()
                path = proc.stderr.write_log(folder)
            entries.append((proc.rank, errors, path))
        if entries:
            log = logger.error if procs is failed else logger.warning
            log(failure_report(entries, verb))


@contextmanager
def forwarding_signals(stop: StopRequest) -> Iterator[None]:
    """Record SIGINT/SIGTERM/SIGHUP in ``stop`` instead of dying, for the supervisor to forward."""

    def record(signum: int, _frame: object) -> None:
        if stop.signum is None:
            stop.signum = signum

    if threading.current_thread() is not threading.main_thread():
        # Python only lets the main thread install handlers; callers there keep the defaults
        yield
        return
    previous = {sig: signal.signal(sig, record) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
