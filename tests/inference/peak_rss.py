"""The peak resident-set growth of this process over a block, sampled by a thread."""

from __future__ import annotations

import os
import threading
import time
from types import TracebackType


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """``with PeakRSS() as rss: ...`` then ``rss.growth``: the highest RSS seen inside the block
    minus the RSS at its start (sampled every 0.5 ms)."""

    def __init__(self) -> None:
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.0005)

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = resident_bytes()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start
