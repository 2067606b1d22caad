"""Process memory statistics for devices whose memory is host RAM (CPU).

"Allocated" is the process's resident set size. Its peak since a reset combines two sources:
the kernel's lifetime peak (``ru_maxrss``), which is exact but cannot be reset, and the largest
RSS this tracker has sampled. If the lifetime peak grew after the reset, the growth happened
inside the window and it is the answer; otherwise the sampled maximum is the best known bound.
"""

from __future__ import annotations

import resource
import sys

import psutil


def _lifetime_peak_rss() -> int:
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    # Linux reports KiB, macOS bytes
    return peak if sys.platform == "darwin" else peak * 1024


class HostMemoryTracker:
    """RSS now, peak RSS since :meth:`reset_peak`, and system totals, all in bytes."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._lifetime_peak_at_reset = _lifetime_peak_rss()
        self._sampled_peak = self.current()

    def current(self) -> int:
        """Resident set size of this process now."""
        return int(self._process.memory_info().rss)

    def peak(self) -> int:
        """Largest resident set size since the last reset (see the module docstring)."""
        now = self.current()
        self._sampled_peak = max(self._sampled_peak, now)
        lifetime = _lifetime_peak_rss()
        if lifetime > self._lifetime_peak_at_reset:
            return max(lifetime, self._sampled_peak)
        return self._sampled_peak

    def reset_peak(self) -> None:
        """Start a new peak window at the current RSS."""
        self._lifetime_peak_at_reset = _lifetime_peak_rss()
        self._sampled_peak = self.current()

    @staticmethod
    def total() -> int:
        """Physical memory of the machine."""
        return int(psutil.virtual_memory().total)

    @staticmethod
    def available() -> int:
        """Memory the system can still hand out without swapping."""
        return int(psutil.virtual_memory().available)
