"""Aligned host buffers and raw byte views of tensors, for positioned and ``O_DIRECT`` I/O.

``O_DIRECT`` transfers bypass the page cache and need the buffer address, the file offset and
the length to be multiples of the device's logical block size. :data:`ALIGNMENT` (4096 bytes)
covers every common block size.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
import warnings

import torch

from shardspeed.accelerator import get_accelerator

__all__ = [
    "ALIGNMENT",
    "aligned_empty",
    "byte_view",
    "direct_io_supported",
    "is_aligned",
    "round_up",
    "writable_buffer",
]

ALIGNMENT = 4096


def round_up(n: int, multiple: int = ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def is_aligned(value: int, multiple: int = ALIGNMENT) -> bool:
    """Whether ``value`` (an address, offset or length) is a multiple of ``multiple``."""
    return value % multiple == 0


def aligned_empty(
    numel: int, dtype: torch.dtype = torch.uint8, *, pin_memory: bool = False
) -> torch.Tensor:
    """A 1-D CPU tensor whose first byte sits on an :data:`ALIGNMENT` boundary.

    With ``pin_memory`` the buffer is page-locked through the accelerator; where there is no
    pinned memory (a CPU-only machine) this warns once and returns ordinary memory.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    if pin_memory:
        pinned = _pinned(raw)
        raw = pinned if pinned is not None else raw
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip : skip + nbytes].view(dtype)


def _pinned(tensor: torch.Tensor) -> torch.Tensor | None:
    accelerator = get_accelerator()
    try:
        pinned = accelerator.pin_memory(tensor)
    except RuntimeError as exc:  # no driver, no pinned memory
        warnings.warn(
            f"pin_memory requested but unavailable ({exc}); using pageable memory", stacklevel=3
        )
        return None
    if not accelerator.is_pinned(pinned):
        warnings.warn(
            "pin_memory requested but this machine has no pinned memory "
            f"(accelerator {accelerator.device_name()!r}); using pageable memory",
            stacklevel=3,
        )
        return None
    return pinned


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat ``uint8`` tensor sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8)


def writable_buffer(tensor: torch.Tensor, start: int = 0, length: int | None = None) -> memoryview:
    """A writable memoryview of ``length`` bytes of a contiguous CPU tensor from byte ``start``.

    The view aliases the tensor's memory: the tensor must outlive every use of the view.
    """
    total = tensor.numel() * tensor.element_size()
    length = total - start if length is None else length
    if length <= 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_ubyte * length).from_address(tensor.data_ptr() + start)
    return memoryview(array).cast("B")


def direct_io_supported(folder: str | os.PathLike[str]) -> bool:
    """Whether files in ``folder`` can be opened and written with ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    fd_tmp, probe = tempfile.mkstemp(prefix=".shardspeed_odirect_", dir=os.fspath(folder))
    os.close(fd_tmp)
    try:
        try:
            fd = os.open(probe, os.O_RDWR | flag)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        try:
            buf = aligned_empty(ALIGNMENT)
            buf.zero_()
            os.pwrite(fd, writable_buffer(buf), 0)
            return True
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        finally:
            os.close(fd)
    finally:
        os.unlink(probe)
