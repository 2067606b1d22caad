"""A failed job's Python errors, told once: tracebacks go to per-rank logs, the terminal gets one
line per distinct error naming the ranks that raised it.

Without ``--enable_each_rank_log`` each rank's stderr comes through a pipe: a
:class:`TracebackFilter` forwards everything to the terminal except Python tracebacks (with or
without torch's ``[rankN]:`` line prefix), whose final ``Type: message`` line it keeps; the raw
stream's recent part stays in memory and becomes the rank's log file if the job fails. With
``--enable_each_rank_log`` the ranks write to their log files as before and the same filter reads
them afterwards. :func:`failure_report` groups the ranks by error.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO

__all__ = ["RankStderr", "TracebackFilter", "errors_in_file", "failure_report"]

_PREFIX = re.compile(rb"^\[rank\d+\]:\s?")
_HEADER = b"Traceback (most recent call last):"
_CHAINED = (b"During handling of the above exception", b"The above exception was the direct")
#: raw stderr kept per rank for its log, from the end
KEEP_BYTES = 1 << 20


class TracebackFilter:
    """Feed a stream's bytes; get back what to show, with Python tracebacks left out.

    ``errors`` lists the final line of each traceback seen (``module.Type: message``).
    """

    def __init__(self) -> None:
        self.errors: list[str] = []
        self._partial = b""
        self._inside = False  # in a traceback, before its exception line
        self._after = False  # just past an exception line: a chained traceback may follow

    def feed(self, data: bytes) -> bytes:
        self._partial += data
        shown = bytearray()
        while (end := self._partial.find(b"\n")) >= 0:
            line, self._partial = self._partial[: end + 1], self._partial[end + 1 :]
            shown += self._line(line)
        # a partial line shows at once (progress bars) unless it may open a traceback
        if self._partial and not self._inside and not self._may_open(self._partial):
            shown += self._partial
            self._partial = b""
        return bytes(shown)

    def close(self) -> bytes:
        """The end of the stream: what is left to show."""
        rest, self._partial = self._partial, b""
        return b"" if self._inside else rest

    @staticmethod
    def _may_open(partial: bytes) -> bool:
        body = _PREFIX.sub(b"", partial)
        return _HEADER.startswith(body) or body.startswith(_HEADER) or partial.startswith(b"[")

    def _line(self, line: bytes) -> bytes:
        prefixed = _PREFIX.match(line) is not None
        body = _PREFIX.sub(b"", line).rstrip(b"\r\n")
        if body.startswith(_HEADER):
            self._inside, self._after = True, False
            return b""
        if self._inside:
            if body[:1] in (b" ", b"\t", b"") or body.startswith(_CHAINED):
                return b""  # frames, source lines, carets
            self.errors.append(body.decode(errors="replace").strip())
            self._inside, self._after = False, True
            return b""
        if self._after and (not body.strip() or body.startswith(_CHAINED) or prefixed):
            return b""  # between chained tracebacks, or torch's prefixed rest of the report
        self._after = False
        return line


class RankStderr:
    """Pumps one rank's stderr pipe: filtered to ``terminal``, the raw tail kept for its log."""

    def __init__(self, rank: int, pipe: IO[bytes], terminal: IO[bytes] | None = None) -> None:
        self.rank = rank
        self.filter = TracebackFilter()
        self._pipe = pipe
        self._terminal = terminal if terminal is not None else sys.stderr.buffer
        self._kept = bytearray()
        self._thread = threading.Thread(target=self._pump, name=f"rank{rank}-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        fd = self._pipe.fileno()
        while chunk := os.read(fd, 65536):
            self._kept += chunk
            del self._kept[:-KEEP_BYTES]
            self._show(self.filter.feed(chunk))
        self._show(self.filter.close())
        self._pipe.close()

    def _show(self, data: bytes) -> None:
        if data:
            self._terminal.write(data)
            self._terminal.flush()

    def finish(self, timeout: float = 2.0) -> None:
        """Wait for the pipe to close (the rank and what inherited its stderr are gone)."""
        self._thread.join(timeout)

    def write_log(self, folder: Path) -> Path:
        path = folder / f"rank{self.rank}.log"
        path.write_bytes(bytes(self._kept))
        return path


def errors_in_file(path: str | Path) -> list[str]:
    """The final lines of the Python tracebacks in a rank's log file."""
    found = TracebackFilter()
    try:
        found.feed(Path(path).read_bytes() + b"\n")
    except OSError:
        return []
    return found.errors


def _names(ranks: list[int]) -> str:
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(str(r) for r in sorted(ranks))}"


def failure_report(
    failed: Iterable[tuple[int, list[str], Path | None]], verb: str = "failed"
) -> str:
    """One line per distinct error: ``ranks 0, 1 <verb>: Type: message`` and where the logs are.

    ``failed``: (rank, the errors its tracebacks ended with, its log file) per rank.
    """
    by_error: dict[str, list[int]] = {}
    logs: list[Path] = []
    for rank, errors, log in failed:
        by_error.setdefault(errors[-1] if errors else "", []).append(rank)
        if log is not None:
            logs.append(log)
    lines = []
    for error, ranks in by_error.items():
        what = error or "no Python traceback (see its output above)"
        lines.append(f"{_names(ranks)} {verb}: {what}")
    if logs:
        folders = sorted({str(p.parent) for p in logs})
        names = ", ".join(p.name for p in logs)
        lines.append(f"full output with tracebacks: {names} in {', '.join(folders)}")
    return "\n".join(lines)


def log_folder() -> Path:
    """A fresh folder for the logs of a failed job's ranks."""
    return Path(tempfile.mkdtemp(prefix="shardspeed-failed-ranks-"))
