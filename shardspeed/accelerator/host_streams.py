"""Streams and events for devices that run synchronously with the host (CPU, MPS streams).

On such devices there is nothing to overlap, so a stream is only a context manager that keeps
code written for CUDA streams working, and an event timestamps the host clock when recorded.
"""

from __future__ import annotations

import contextlib
import time
from types import TracebackType
from typing import Any


class HostStream:
    """A stream that queues nothing: work is already complete when the call returns."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.priority = priority

    def __enter__(self) -> HostStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def synchronize(self) -> None:
        """Nothing is pending, so there is nothing to wait for."""

    def query(self) -> bool:
        """Always True: no work is ever pending."""
        return True

    def wait_stream(self, stream: Any) -> None:
        """No-op: every stream is always complete."""

    def wait_event(self, event: Any) -> None:
        """No-op: every event is complete once recorded."""

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        """Record ``event`` (a new one when None) at the current host time and return it."""
        event = event if event is not None else HostEvent()
        event.record(self)
        return event


_DEFAULT_STREAM = HostStream()


def default_host_stream() -> HostStream:
    """The single stream every synchronous device shares."""
    return _DEFAULT_STREAM


class HostEvent:
    """An event that stores the host clock when recorded; ``elapsed_time`` is in milliseconds."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self._time_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        """Stamp the current host time."""
        self._time_ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        """No-op: the work before a host event is done when it is recorded."""

    def query(self) -> bool:
        """True once recorded."""
        return self._time_ns is not None

    def wait(self, stream: Any = None) -> None:
        """No-op: nothing to wait for."""

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s record."""
        if self._time_ns is None or end_event._time_ns is None:
            raise RuntimeError("both events must be recorded before elapsed_time() is called")
        return (end_event._time_ns - self._time_ns) / 1e6


class HostStreamsMixin:
    """Stream methods of an accelerator whose work is ordered by the host (CPU; MPS, whose
    command queue is implicit): streams are no-op contexts and the current stream is shared."""

    @property
    def Stream(self) -> type:  # noqa: N802 - DeepSpeed's name
        return HostStream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def current_stream(self, device_index: int | None = None) -> HostStream:
        return default_host_stream()

    def default_stream(self, device_index: int | None = None) -> HostStream:
        return default_host_stream()
