"""``SwapHandle``: one asynchronous read or write, made of block requests run by the pool."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from shardspeed.runtime.swap.errors import SwapError

__all__ = ["SwapHandle"]


class SwapHandle:
    """One read or write in flight; :meth:`wait` blocks until every block has completed.

    ``on_complete`` (if given) runs exactly once, on the pool thread that finished the last
    block, with the first error or None; the swapper uses it to mark a file valid or not.
    """

    def __init__(
        self,
        kind: str,
        key: str,
        *,
        keep_alive: tuple[object, ...] = (),
        on_complete: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.kind = kind
        self.key = key
        self._keep_alive = keep_alive  # the caller's tensor stays referenced while I/O runs
        self._on_complete = on_complete
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._outstanding = 0
        self._sealed = False
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self.reported = False
        """Whether :meth:`wait` has already raised this operation's error to a caller."""

    # ------------------------------------------------------------------ built by the swapper
    def add(self, future: Future[None]) -> None:
        """Count ``future`` as one more part of this operation."""
        with self._lock:
            self._outstanding += 1
            self._futures.append(future)
        future.add_done_callback(self._part_done)

    def seal(self) -> None:
        """No more parts will be added; completes at once if all parts are already done."""
        with self._lock:
            self._sealed = True
            finished = self._outstanding == 0
        if finished:
            self._finish()

    def _part_done(self, future: Future[None]) -> None:
        error = future.exception()
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._outstanding -= 1
            finished = self._sealed and self._outstanding == 0
        if finished:
            self._finish()

    def _finish(self) -> None:
        if self._on_complete is not None:
            self._on_complete(self._error)
        self._keep_alive = ()
        self._futures = []
        self._finished.set()

    # ------------------------------------------------------------------ public
    def done(self) -> bool:
        """Whether every block of this operation has completed (successfully or not)."""
        return self._finished.is_set()

    def join(self) -> BaseException | None:
        """Wait for completion without raising; the error, if any."""
        self._finished.wait()
        return self._error

    def wait(self) -> None:
        """Wait for completion; raise :class:`SwapError` if any block failed or read short."""
        error = self.join()
        if error is None:
            return
        self.reported = True
        if isinstance(error, SwapError):
            raise error
        path = getattr(error, "filename", None)
        raise SwapError(
            f"swap {self.kind} of key {self.key!r} failed: {error}",
            path=path,
            fix="check the disk under nvme_path; the key's file is unreadable until written again",
        ) from error
