"""One swap file: its descriptor, its reserved space, and positioned reads and writes into it."""

from __future__ import annotations

import errno
import os
import re
import threading
from dataclasses import dataclass, field

from shardspeed.runtime.swap.aligned import round_up
from shardspeed.runtime.swap.errors import SwapError
from shardspeed.runtime.swap.handle import SwapHandle

__all__ = ["SwapFile", "file_name_for", "pread_full", "pwrite_full"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def file_name_for(key: str) -> str:
    """A file name for ``key``: safe characters kept, others escaped as ``%xx``."""
    if not key:
        raise ValueError("swap key must be a non-empty string")
    safe = _UNSAFE.sub(lambda m: "".join(f"%{b:02x}" for b in m.group().encode()), key)
    if safe.startswith("."):
        safe = "%2e" + safe[1:]
    return f"{safe}.swp"


def pwrite_full(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Write all of ``buf`` at ``offset``, retrying short writes; a write of 0 bytes is an error."""
    done = 0
    while done < len(buf):
        written = os.pwrite(fd, buf[done:], offset + done)
        if written <= 0:
            raise SwapError(
                "short write to swap file",
                path=path,
                offset=offset,
                expected=len(buf),
                got=done,
                fix="check the disk under nvme_path (space, health) and write the key again",
            )
        done += written


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Read into all of ``buf`` from ``offset`` until it is full or the file ends; bytes read."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


@dataclass
class SwapFile:
    """A key's file: ``capacity`` bytes reserved on disk, ``nbytes`` of them hold the payload.

    ``valid`` is False from the moment a write is submitted until it has completed without
    error: a failed or unfinished write leaves the file unreadable rather than silently torn.
    """

    key: str
    path: str
    fd: int
    direct: bool
    capacity: int = 0
    nbytes: int = 0
    valid: bool = False
    pending: list[SwapHandle] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, key: str, path: str, *, direct: bool) -> SwapFile:
        """Open (creating) ``path``; ``O_DIRECT`` when asked and accepted, buffered otherwise."""
        flags = os.O_RDWR | os.O_CREAT
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                return cls(key, path, fd, True, capacity=os.fstat(fd).st_size)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        fd = os.open(path, flags, 0o600)
        return cls(key, path, fd, False, capacity=os.fstat(fd).st_size)

    def reserve(self, nbytes: int, folder: str, created: bool) -> None:
        """Allocate disk blocks for ``nbytes`` (rounded up to the I/O alignment) before any write.

        On a full disk the file is returned to its previous size and :class:`SwapError` names
        the bytes needed and free; the payload already there is untouched.
        """
        needed = round_up(nbytes)
        if needed <= self.capacity:
            return
        try:
            os.posix_fallocate(self.fd, 0, needed)
        except OSError as exc:
            free = _free_bytes(folder)
            os.ftruncate(self.fd, self.capacity)
            if exc.errno == errno.ENOSPC or (free is not None and free < needed - self.capacity):
                raise SwapError(
                    f"not enough space under nvme_path {folder!r} for swap key {self.key!r}: "
                    f"needs {needed - self.capacity} more bytes, {free} free"
                    + (" (new file removed)" if created else " (previous contents kept)"),
                    path=self.path,
                    offset=0,
                    expected=needed,
                    fix="free disk space, point nvme_path at a larger disk, or offload less",
                ) from exc
            raise SwapError(
                f"could not reserve space for swap key {self.key!r}: {exc}",
                path=self.path,
                expected=needed,
                fix="use a local filesystem that supports fallocate for nvme_path",
            ) from exc
        self.capacity = needed

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _free_bytes(folder: str) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
