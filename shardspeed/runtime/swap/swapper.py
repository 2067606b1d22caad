"""``TensorSwapper``: asynchronous tensor reads and writes to files under ``nvme_path``.

Pure Python: a thread pool runs positioned reads and writes (``os.preadv`` / ``os.pwrite``,
which release the GIL) block by block, with ``O_DIRECT`` where the filesystem accepts it and
buffered I/O where it does not. ``O_DIRECT`` blocks that are not aligned in memory or length go
through a per-thread aligned bounce buffer; buffers from :meth:`TensorSwapper.allocate` are
aligned, so whole blocks move with no copy.

The ``aio`` section is honoured as follows:

- ``block_size``: bytes per request (one system call); rounded up to 4096 under ``O_DIRECT``.
- ``intra_op_parallelism``: worker threads (DeepSpeed's former ``thread_count``).
- ``queue_depth``: at most ``queue_depth x threads`` submissions are queued or running at once
  (a submission is one request, or with ``single_submit=False`` a batch of up to
  ``queue_depth`` requests); a caller that would exceed that waits in
  :meth:`~TensorSwapper.write` / :meth:`~TensorSwapper.read` for a free slot (never fails).
- ``single_submit``: True hands requests to the pool one by one; False (default) hands them in
  batches of up to ``queue_depth`` per worker task (fewer hand-offs between threads), an
  operation's requests spread over all threads.
- ``overlap_events``: True (default) lets a new operation start while earlier ones complete;
  False makes each operation wait for all earlier ones first.
- ``use_gds``: not available (it needs a native GPUDirect Storage binding); warns and goes on.

What a caller must do to keep state safe:

1. Call :meth:`~TensorSwapper.reserve` (or let :meth:`~TensorSwapper.write` do it) *before*
   overwriting state: the space is allocated up front, so a full disk raises :class:`SwapError`
   there, before a single byte of the old contents is touched.
2. Keep a tensor passed to :meth:`~TensorSwapper.write` unchanged, and one passed to
   :meth:`~TensorSwapper.read` untouched, until the handle's :meth:`~SwapHandle.wait` returns.
3. Call :meth:`~SwapHandle.wait` (or :meth:`~TensorSwapper.wait_all`) and let its error
   propagate. A write that failed part-way (an I/O error) leaves that key marked invalid: every
   later read of it raises :class:`SwapError` until it is written again successfully, so a torn
   file is never returned as data. A caller that must still have the *old* values after such an
   error writes to a new key and switches over with :meth:`~TensorSwapper.rename` after wait().

Swap files are scratch: no ``fsync``, and :meth:`~TensorSwapper.close` deletes the files this
swapper made unless told to keep them. Use one swapper per folder per process.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

import torch

from shardspeed.config.aio import AioConfig
from shardspeed.runtime.swap.aligned import (
    ALIGNMENT,
    aligned_empty,
    byte_view,
    direct_io_supported,
    is_aligned,
    round_up,
    writable_buffer,
)
from shardspeed.runtime.swap.errors import SwapError, SwapPathError
from shardspeed.runtime.swap.handle import SwapHandle
from shardspeed.runtime.swap.swap_file import SwapFile, file_name_for, pread_full, pwrite_full

__all__ = ["SwapError", "SwapHandle", "SwapPathError", "TensorSwapper"]

Request = tuple[int, int]  # (byte offset, length) within one tensor and its file


class TensorSwapper:
    """Asynchronous, positioned tensor I/O to one file per key under ``folder``.

    Args:
        folder: the swap folder (``nvme_path``); must exist and be writable.
        aio: the ``aio`` config section; defaults when None.
        pin_memory: buffers from :meth:`allocate` are page-locked (warns where impossible).
        o_direct: None (default) uses ``O_DIRECT`` if the filesystem accepts it; True
            requires it (error otherwise); False always uses buffered I/O.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        aio: AioConfig | None = None,
        *,
        pin_memory: bool = False,
        o_direct: bool | None = None,
    ) -> None:
        self.folder = _checked_folder(folder)
        self.aio = aio if aio is not None else AioConfig()
        if self.aio.use_gds:
            warnings.warn(
                "aio.use_gds: GPUDirect Storage needs a native driver binding, which shardspeed "
                "(pure Python) does not have; swapping through host memory instead",
                stacklevel=2,
            )
        self.pin_memory = pin_memory
        supported = direct_io_supported(self.folder)
        if o_direct and not supported:
            raise SwapPathError(
                f"nvme_path {self.folder!r} does not support O_DIRECT",
                path=self.folder,
                fix="pass o_direct=None to fall back to buffered I/O, or use a local disk",
            )
        self.direct = supported if o_direct is None else bool(o_direct)
        self.block_size = round_up(self.aio.block_size) if self.direct else self.aio.block_size
        self.threads = self.aio.intra_op_parallelism
        self._slots = threading.BoundedSemaphore(self.aio.queue_depth * self.threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardspeed-swap")
        self._local = threading.local()
        self._files: dict[str, SwapFile] = {}
        self._lock = threading.Lock()
        self._inflight: list[SwapHandle] = []
        self._closed = False

    # ------------------------------------------------------------------ public API
    def allocate(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An aligned (and pinned if asked) 1-D CPU buffer: ``O_DIRECT`` I/O with no copy."""
        return aligned_empty(numel, dtype, pin_memory=self.pin_memory)

    def reserve(self, key: str, nbytes: int) -> None:
        """Allocate space on disk for ``nbytes`` under ``key`` now; :class:`SwapError` if full."""
        self._check_open()
        if nbytes < 0:
            raise ValueError(f"reserve({key!r}, nbytes={nbytes}): nbytes must be >= 0")
        created = key not in self._files
        file = self._file(key)
        self._join_key(file)
        try:
            file.reserve(nbytes, self.folder, created)
        except SwapError:
            if created:
                self._drop(key, unlink=True)
            raise

    def write(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing ``tensor``'s bytes to ``key``; space is reserved first (may raise)."""
        self._check_open()
        _check_tensor("write", key, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.reserve(key, nbytes)  # a full disk stops here, old contents intact
        file = self._files[key]
        file.valid = False
        file.nbytes = nbytes
        src = byte_view(tensor)

        def complete(error: BaseException | None) -> None:
            file.valid = error is None

        handle = SwapHandle("write", key, keep_alive=(tensor, src), on_complete=complete)
        self._submit(file, handle, nbytes, lambda off, n: self._write_block(file, src, off, n))
        return handle

    def read(self, key: str, into: torch.Tensor) -> SwapHandle:
        """Start reading ``key`` into ``into`` (a contiguous CPU tensor of the saved byte size)."""
        self._check_open()
        _check_tensor("read", key, into)
        file = self._files.get(key)
        if file is None:
            raise SwapError(
                f"no swap data for key {key!r}",
                fix="write the key before reading it (keys: "
                + ", ".join(sorted(self._files))
                + ")",
            )
        self._join_key(file)
        if not file.valid:
            raise SwapError(
                f"swap key {key!r} holds no valid data: its last write failed or never ran",
                path=file.path,
                expected=file.nbytes,
                fix="write the key again before reading it",
            )
        nbytes = into.numel() * into.element_size()
        if nbytes != file.nbytes:
            raise ValueError(
                f"read({key!r}): destination holds {nbytes} bytes but {file.nbytes} were saved; "
                "pass a tensor of the saved size"
            )
        dst = byte_view(into)
        handle = SwapHandle("read", key, keep_alive=(into, dst))
        self._submit(file, handle, nbytes, lambda off, n: self._read_block(file, dst, off, n))
        return handle

    def wait_all(self) -> None:
        """Wait for every operation in flight; raise the first error not already raised by wait()."""
        with self._lock:
            handles, self._inflight = self._inflight, []
        first: SwapError | None = None
        for handle in handles:
            already_raised = handle.reported
            try:
                handle.wait()
            except SwapError as exc:
                if not already_raised:
                    first = first or exc
        if first is not None:
            raise first

    def remove(self, key: str) -> None:
        """Delete ``key``'s file (after its operations in flight finish); no error if absent."""
        file = self._files.get(key)
        if file is not None:
            self._join_key(file)
            self._drop(key, unlink=True)

    def rename(self, src: str, dst: str) -> None:
        """Atomically make ``src``'s data the data of ``dst`` (replacing it); ``src`` is gone."""
        self._check_open()
        file = self._files.get(src)
        if file is None:
            raise SwapError(f"no swap data for key {src!r}", fix="write the key before renaming it")
        self._join_key(file)
        if dst in self._files:
            self._join_key(self._files[dst])
            self._drop(dst, unlink=False)
        path = os.path.join(self.folder, file_name_for(dst))
        os.replace(file.path, path)
        with self._lock:
            del self._files[src]
            file.key, file.path = dst, path
            self._files[dst] = file

    def nbytes(self, key: str) -> int:
        """Bytes last written under ``key``."""
        return self._files[key].nbytes

    def path(self, key: str) -> str:
        """The file that holds ``key``."""
        return self._files[key].path

    def keys(self) -> Iterator[str]:
        """Keys with a file."""
        return iter(list(self._files))

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def close(self, *, remove_files: bool = True) -> None:
        """Finish all I/O, stop the threads, close the files and (by default) delete them."""
        if self._closed:
            return
        with self._lock:
            handles, self._inflight = self._inflight, []
        for handle in handles:
            handle.join()
        self._pool.shutdown(wait=True)
        for key in list(self._files):
            self._drop(key, unlink=remove_files)
        self._closed = True

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:  # the caller forgot close(): keep its files, release descriptors and threads
                self.close(remove_files=False)
            except Exception:  # noqa: BLE001 - nothing can be reported from a finalizer
                pass

    # ------------------------------------------------------------------ submission
    def _submit(
        self,
        file: SwapFile,
        handle: SwapHandle,
        nbytes: int,
        block: Callable[[int, int], None],
    ) -> None:
        if not self.aio.overlap_events:
            self._join_all()
        requests = [
            (off, min(self.block_size, nbytes - off)) for off in range(0, nbytes, self.block_size)
        ]
        batch = 1 if self.aio.single_submit else self.aio.queue_depth
        # spread a small operation over all threads rather than one batch on one thread
        batch = max(1, min(batch, -(-len(requests) // self.threads)))
        with file.lock:
            file.pending = [h for h in file.pending if not h.done()] + [handle]
        with self._lock:
            self._inflight = [h for h in self._inflight if not h.done()]
            self._inflight.append(handle)
        for start in range(0, len(requests), batch):
            self._slots.acquire()  # a full queue makes the caller wait, never fail
            chunk = requests[start : start + batch]
            handle.add(self._pool.submit(self._run, file, chunk, block))
        handle.seal()

    def _run(
        self, file: SwapFile, requests: list[Request], block: Callable[[int, int], None]
    ) -> None:
        try:
            for offset, length in requests:
                try:
                    block(offset, length)
                except OSError as exc:
                    raise SwapError(
                        f"I/O error on swap key {file.key!r}: {exc}",
                        path=file.path,
                        offset=offset,
                        expected=length,
                        fix="check the disk under nvme_path; write the key again before reading it",
                    ) from exc
        finally:
            self._slots.release()

    # ------------------------------------------------------------------ one block each way
    def _bounce(self) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = aligned_empty(round_up(self.block_size))
            self._local.buf = buf
        return buf

    def _zero_copy(self, tensor: torch.Tensor, offset: int, length: int) -> bool:
        return not self.direct or (
            is_aligned(tensor.data_ptr() + offset) and is_aligned(length, ALIGNMENT)
        )

    def _write_block(self, file: SwapFile, src: torch.Tensor, offset: int, length: int) -> None:
        if self._zero_copy(src, offset, length):
            pwrite_full(file.fd, writable_buffer(src, offset, length), offset, file.path)
            return
        bounce = self._bounce()
        padded = round_up(length)
        bounce[:length].copy_(src[offset : offset + length])
        bounce[length:padded].zero_()
        pwrite_full(file.fd, writable_buffer(bounce, 0, padded), offset, file.path)

    def _read_block(self, file: SwapFile, dst: torch.Tensor, offset: int, length: int) -> None:
        if self._zero_copy(dst, offset, length):
            got = pread_full(file.fd, writable_buffer(dst, offset, length), offset)
        else:
            bounce = self._bounce()
            got = pread_full(file.fd, writable_buffer(bounce, 0, round_up(length)), offset)
            if got >= length:
                dst[offset : offset + length].copy_(bounce[:length])
        if got < length:
            raise SwapError(
                f"short read of swap key {file.key!r} (file truncated or replaced?)",
                path=file.path,
                offset=offset,
                expected=length,
                got=got,
                fix="the file under nvme_path was changed behind the swapper; write the key again",
            )

    # ------------------------------------------------------------------ bookkeeping
    def _file(self, key: str) -> SwapFile:
        with self._lock:
            file = self._files.get(key)
            if file is None:
                path = os.path.join(self.folder, file_name_for(key))
                file = SwapFile.open(key, path, direct=self.direct)
                self._files[key] = file
            return file

    def _join_key(self, file: SwapFile) -> None:
        with file.lock:
            pending, file.pending = file.pending, []
        for handle in pending:
            handle.join()

    def _join_all(self) -> None:
        with self._lock:
            handles = list(self._inflight)
        for handle in handles:
            handle.join()

    def _drop(self, key: str, *, unlink: bool) -> None:
        with self._lock:
            file = self._files.pop(key, None)
        if file is None:
            return
        file.close()
        if unlink:
            try:
                os.unlink(file.path)
            except FileNotFoundError:
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TensorSwapper is closed")


def _checked_folder(folder: str | os.PathLike[str]) -> str:
    path = os.fspath(folder)
    if not os.path.exists(path):
        raise SwapPathError(
            f"nvme_path {path!r} does not exist",
            path=path,
            fix="create the folder (on a local NVMe disk) or set nvme_path to an existing one",
        )
    if not os.path.isdir(path):
        raise SwapPathError(
            f"nvme_path {path!r} is not a folder", path=path, fix="set nvme_path to a folder"
        )
    probe = os.path.join(path, f".shardspeed_write_probe_{os.getpid()}")
    try:  # os.access lies for root and on some network filesystems: really try
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise SwapPathError(
            f"nvme_path {path!r} is not writable: {exc.strerror}",
            path=path,
            fix="give this user write permission there or choose another nvme_path",
        ) from exc
    return path


def _check_tensor(verb: str, key: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{verb}({key!r}): expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{verb}({key!r}): tensor is on {tensor.device}; swap I/O needs a CPU tensor "
            "(copy it to host memory first)"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{verb}({key!r}): tensor must be contiguous (call .contiguous())")
