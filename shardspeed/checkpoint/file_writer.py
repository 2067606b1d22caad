"""Writing one checkpoint file: ``torch.save`` to a temporary name, fsync, atomic rename, and the
file's size and CRC-32 (computed from the bytes as they are written) for the manifest."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import IO, Any, cast

import torch

from shardspeed.checkpoint import crash_points, durable
from shardspeed.checkpoint.manifest import FileRecord


class _CountingFile:
    """A binary file that keeps the size and CRC-32 of what is written through it."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.size = 0
        self.crc32 = 0

    def write(self, data: Any) -> int:
        crash_points.reached("write")
        view = memoryview(data)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes
        written: int = self._file.write(view)
        return written

    def flush(self) -> None:
        self._file.flush()


def save_file(obj: Any, folder: Path, name: str, zip_format: bool = True) -> FileRecord:
    """``torch.save(obj)`` as ``folder/name``, durably: written to ``name.tmp``, fsync'd, renamed
    into place. ``zip_format=False``: torch's legacy format (``checkpoint_serialization``)."""
    path = folder / name
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as raw:
        counted = _CountingFile(raw)
        # torch.save writes through counted.write (a file-like object)
        torch.save(obj, cast(IO[bytes], counted), _use_new_zipfile_serialization=zip_format)
        raw.flush()
        crash_points.reached("fsync")
        os.fsync(raw.fileno())
    crash_points.reached("rename")
    durable.replace(tmp, path)
    crash_points.reached("renamed")
    return {"name": name, "size": counted.size, "crc32": counted.crc32}
