"""Durable file operations: a file or rename is on disk (fsync'd) before the next step relies
on it, so a crash or power loss leaves either the old state or the new one."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make the entries of ``folder`` (files created, renamed or removed in it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` atomically (replacing it) and durably."""
    os.replace(source, target)
    fsync_dir(target.parent)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old content or all of the new."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    replace(tmp, path)
