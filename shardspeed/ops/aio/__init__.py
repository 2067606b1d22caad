"""DeepSpeed's ``ops.aio``: ``aio_handle``, the file I/O handle that ``AsyncIOBuilder().load()``
returns, in pure Python on shardspeed's swapper primitives.

A handle reads and writes whole tensors from and to files, splitting each transfer into
``block_size`` pieces run by ``intra_op_parallelism`` threads (positioned ``os.preadv`` /
``os.pwrite``, which release the GIL). Synchronous calls return the number of completed
operations (1); ``async_*`` calls schedule and :meth:`aio_handle.wait` returns how many
completed. Buffers are CPU tensors (contiguous); ``new_cpu_locked_tensor`` hands out pinned
memory where the accelerator has it, ordinary memory otherwise.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardspeed.runtime.swap.aligned import writable_buffer
from shardspeed.runtime.swap.errors import SwapError
from shardspeed.runtime.swap.swap_file import pread_full, pwrite_full

__all__ = ["aio_handle"]


class aio_handle:  # noqa: N801 - DeepSpeed's name
    """File reads and writes of tensors, in ``block_size`` pieces over a thread pool."""

    def __init__(
        self,
        block_size: int = 1_048_576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        if block_size <= 0 or queue_depth <= 0 or intra_op_parallelism <= 0:
            raise ValueError(
                "aio_handle: block_size, queue_depth and intra_op_parallelism must be positive "
                f"(got {block_size}, {queue_depth}, {intra_op_parallelism})"
            )
        self._block_size = block_size
        self._queue_depth = queue_depth
        self._single_submit = single_submit
        self._overlap_events = overlap_events
        self._threads = intra_op_parallelism
        self._pool = ThreadPoolExecutor(intra_op_parallelism, thread_name_prefix="ss-aio")
        self._pending: list[list[Future[None]]] = []
        self._locked: list[torch.Tensor] = []

    # -- settings (DeepSpeed's getters) ----------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._threads

    get_thread_count = get_intra_op_parallelism

    # -- transfers -------------------------------------------------------------------------
    def _start(self, buffer: torch.Tensor, filename: str, write: bool) -> list[Future[None]]:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(
                f"aio_handle: {filename}: the buffer must be a contiguous CPU tensor "
                f"(got {buffer.device}, contiguous={buffer.is_contiguous()})"
            )
        nbytes = buffer.numel() * buffer.element_size()
        if write:
            fd = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            if not os.path.exists(filename):
                raise FileNotFoundError(f"aio_handle: no file {filename!r} to read")
            size = os.path.getsize(filename)
            if size < nbytes:
                raise SwapError(
                    "file shorter than the buffer",
                    path=filename,
                    offset=0,
                    expected=nbytes,
                    got=size,
                    fix="read into a buffer of the file's size",
                )
            fd = os.open(filename, os.O_RDONLY)
        view = writable_buffer(buffer)
        futures = [
            self._pool.submit(self._block, fd, view, start, write, filename)
            for start in range(0, nbytes, self._block_size)
        ]
        futures.append(self._pool.submit(_close_after, fd, list(futures)))
        return futures

    def _block(self, fd: int, view: memoryview, start: int, write: bool, filename: str) -> None:
        piece = view[start : start + self._block_size]
        if write:
            pwrite_full(fd, piece, start, filename)
        elif pread_full(fd, piece, start) != len(piece):
            raise SwapError(
                "short read", path=filename, offset=start, expected=len(piece), got=0, fix=""
            )

    def _run(self, buffer: torch.Tensor, filename: str, write: bool, validate: bool) -> int:
        for future in self._start(buffer, filename, write):
            future.result()
        if validate:
            self._validate(buffer, filename)
        return 1

    @staticmethod
    def _validate(buffer: torch.Tensor, filename: str) -> None:
        """Compare the file with the buffer byte for byte (``validate=True``)."""
        with open(filename, "rb") as handle:
            data = handle.read(buffer.numel() * buffer.element_size())
        if bytes(writable_buffer(buffer)) != data:
            raise SwapError(
                "validation failed: the file and the buffer differ",
                path=filename,
                offset=0,
                expected=buffer.numel() * buffer.element_size(),
                got=len(data),
                fix="check the disk",
            )

    def read(self, buffer: torch.Tensor, filename: str, validate: bool = False) -> int:
        return self._run(buffer, filename, False, validate)

    def write(self, buffer: torch.Tensor, filename: str, validate: bool = False) -> int:
        return self._run(buffer, filename, True, validate)

    def pread(
        self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False
    ) -> int:
        if async_op:
            self._pending.append(self._start(buffer, filename, False))
            return 0
        return self._run(buffer, filename, False, validate)

    def pwrite(
        self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False
    ) -> int:
        if async_op:
            self._pending.append(self._start(buffer, filename, True))
            return 0
        return self._run(buffer, filename, True, validate)

    def sync_pread(self, buffer: torch.Tensor, filename: str) -> int:
        return self._run(buffer, filename, False, False)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str) -> int:
        return self._run(buffer, filename, True, False)

    def async_pread(self, buffer: torch.Tensor, filename: str) -> int:
        return self.pread(buffer, filename, False, True)

    def async_pwrite(self, buffer: torch.Tensor, filename: str) -> int:
        return self.pwrite(buffer, filename, False, True)

    def wait(self) -> int:
        """Wait for the scheduled operations; the number that completed (errors raise)."""
        pending, self._pending = self._pending, []
        for futures in pending:
            for future in futures:
                future.result()
        return len(pending)

    # -- buffers ---------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype)
        if torch.cuda.is_available():
            tensor = tensor.pin_memory()
        self._locked.append(tensor)
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        before = len(self._locked)
        self._locked = [t for t in self._locked if t is not tensor]
        return len(self._locked) < before


def _close_after(fd: int, futures: list[Future[None]]) -> None:
    """Close ``fd`` once the blocks using it finished (their errors surface there)."""
    try:
        for future in futures:
            future.exception()
    finally:
        os.close(fd)
