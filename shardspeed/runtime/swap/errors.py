"""Errors of the NVMe tensor swapper: each names the file, the offset, the bytes and the fix."""

from __future__ import annotations

import os

__all__ = ["SwapError", "SwapPathError"]


class SwapError(RuntimeError):
    """A swap read, write or reservation that did not complete.

    ``path``, ``offset``, ``expected`` and ``got`` are kept as attributes (None where they do not
    apply) so a caller can log or test them; the message states them and what to do.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        offset: int | None = None,
        expected: int | None = None,
        got: int | None = None,
        fix: str | None = None,
    ) -> None:
        parts = [message]
        if path is not None:
            parts.append(f"file {os.fspath(path)!s}")
        if offset is not None:
            parts.append(f"offset {offset}")
        if expected is not None:
            parts.append(f"expected {expected} bytes")
        if got is not None:
            parts.append(f"got {got} bytes")
        text = "; ".join(parts)
        if fix:
            text += f". Fix: {fix}"
        super().__init__(text)
        self.path = None if path is None else os.fspath(path)
        self.offset = offset
        self.expected = expected
        self.got = got
        self.fix = fix


class SwapPathError(SwapError, ValueError):
    """The swap folder (``nvme_path``) is missing, not a folder or not writable: a user error."""
