"""The one owner of a shard group's collectives in flight.

A launched reduction is a work handle plus what to do once it is done (copy the result into
place, scale it, release the bucket's buffer). :class:`Inflight` keeps them in launch order,
finishes the oldest when more than ``limit`` are pending (a reduction holds memory until it is
finished: stage 2's staged bucket, the receive buffer of gloo's all-to-all path) and finishes
the rest on :meth:`drain`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


class Inflight:
    """Collectives launched and not yet finished; ``limit=None`` lets all run until drained."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._pending: deque[tuple[Any, Callable[[], None]]] = deque()

    def add(self, work: Any, finish: Callable[[], None]) -> None:
        """Track ``work``; ``finish`` runs after it has completed."""
        self._pending.append((work, finish))
        while self.limit is not None and len(self._pending) > self.limit:
            self._finish_oldest()

    def drain(self) -> None:
        """Wait for every pending collective and finish it, in launch order."""
        while self._pending:
            self._finish_oldest()

    def __len__(self) -> int:
        return len(self._pending)

    def _finish_oldest(self) -> None:
        work, finish = self._pending.popleft()
        if work is not None:
            work.wait()
        finish()
