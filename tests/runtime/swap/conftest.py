"""Fixtures for swapper tests: tiny or read-only filesystems when this process may mount them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(target: Path, options: str) -> Iterator[str | None]:
    """Mount a tmpfs at ``target`` for the block; yields None when mounted, else why not."""
    if os.geteuid() != 0:
        yield "needs root to mount a size-limited tmpfs"
        return
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        yield f"mount -t tmpfs failed: {result.stderr.strip()}"
        return
    try:
        yield None
    finally:
        # a process still holding a file there (a timed-out rank) makes umount fail: detach it
        # lazily instead of leaving the mount behind
        if subprocess.run(["umount", str(target)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: allocations past that fail with ENOSPC."""
    target = tmp_path / "tiny"
    target.mkdir()
    with mounted_tmpfs(target, "size=1M") as why:
        if why:
            pytest.skip(why)
        yield target


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody may write: a read-only tmpfs as root (root ignores mode bits), else 0o500."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o500)
        yield target
        target.chmod(0o700)
        return
    with mounted_tmpfs(target, "size=64k,ro") as why:
        if why:
            pytest.skip(why)
        yield target
