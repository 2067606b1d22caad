"""A pool of real distributed ranks that many tests share.

Spawning a rank and importing torch costs seconds, so a pool of ``world_size`` processes is
started once (per world size, per test session) and joined into one process group. Each test
then sends a module-level function to every rank with :meth:`DistributedPool.run` and gets the
per-rank return values back. A call that fails on any rank, or does not finish within its
timeout, tears the pool down (a peer of a failed rank may be stuck in a collective) and raises;
the next call starts a fresh pool.

Backend: gloo on CPU by default; ``SHARDSPEED_TEST_BACKEND=nccl`` runs the ranks on CUDA devices.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDSPEED_TEST_TIMEOUT", "180"))


class RankFailure(AssertionError):
    """A function failed on one or more ranks; the message holds each rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, backend: str, conn: Connection) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    conn.send(("ready", None))
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    # leave without the interpreter's teardown (freeing torch's modules one by one takes a
    # rank about a second of CPU, many seconds for a pool of ranks sharing a few cores): the
    # rank holds nothing else to release, and its output streams are flushed here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class DistributedPool:
    """``world_size`` live ranks in one process group, reused across calls."""

    def __init__(self, world_size: int, backend: str | None = None) -> None:
        self.world_size = world_size
        self.backend = backend or os.environ.get("SHARDSPEED_TEST_BACKEND", "gloo")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self, timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self.backend, child),
                daemon=True,
                name=f"shardspeed-test-rank{rank}",
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start", timeout_s)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive:
            self.close()
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(remaining, 0)) if remaining > 0 else []
            if not ready:
                self.close(grace_s=1.0)  # the pending ranks are stuck: no use waiting on them
                raise TimeoutError(
                    f"{what}: ranks {sorted(pending)} did not finish within {timeout_s:.0f}s"
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items())
                )
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = (
                        "error",
                        f"rank {rank} died (exit code {self._procs[rank].exitcode})",
                    )
                if status == "error":
                    errors[rank] = value
                    # a peer of a failed rank may wait forever in a collective: give it a moment
                    deadline = min(deadline, time.monotonic() + 10)
                else:
                    results[rank] = value
        if errors:
            self.close()
            raise RankFailure(
                f"{what} failed on ranks {sorted(errors)}"
                + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            )
        return [results[r] for r in range(self.world_size)]

    def close(self, grace_s: float = 5.0) -> None:
        """Ask every rank to leave; a rank still alive ``grace_s`` later (one stuck in a
        collective or in the test's function) is killed."""
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + grace_s  # one grace for all the ranks, not one each
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs.clear()
        self._conns.clear()
