"""ZeRO-Infinity's NVMe swapping: ``offload_optimizer.device: nvme`` (the optimizer state)
and ``offload_param.device: nvme`` (stage 3's parameter shards).

Between steps the optimizer state of the offloaded masters (Adam's ``exp_avg`` and
``exp_avg_sq``, every state tensor the size of its master) lives in files under ``nvme_path``
and holds no memory. The step runs ``sub_group_size`` elements at a time: the state of sub-group
``k+1`` is read while ``k`` steps, and ``k``'s is written back behind it, so at most three
sub-groups' state is in memory at once. Each file is preallocated before its first write, so a
full disk is found before any state is overwritten; a failed read or write stops the step with
the file named, and the state on disk stays the last complete one.

The masters stay in memory, unless they are stage 3 parameter shards offloaded with
``offload_param``: then the shard is read before its unit is gathered and before its
sub-group steps, and leaves memory after (written back only when it changed). With fp16/bf16
parameters the fp32 master copies stay in host memory. A shard in device memory (one rank,
where the shard is the parameters' own buffer) is written and read through a host copy.
"""

from __future__ import annotations

import os
import shutil
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardspeed.runtime.swap.swapper import SwapHandle


def _resident(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


#: (file key, tensor): a state tensor and the file it lives in between steps
Item = tuple[str, torch.Tensor]


class SwapStore:
    """Keeps tensors in files while they are not in use, one file per key: optimizer state
    (one per master and state) and parameter shards (registered ones)."""

    def __init__(self, folder: Path, rank: int, aio: Any = None, pin_memory: bool = False) -> None:
        self.folder = Path(folder) / f"swap_rank{rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        from shardspeed.runtime.swap.swapper import TensorSwapper

        self.swapper = TensorSwapper(self.folder, aio, pin_memory=pin_memory)
        #: bytes of each file written so far (reserved before its first write)
        self._nbytes: dict[str, int] = {}
        #: keys whose file holds the current value of a tensor with no memory now
        self._on_disk: set[str] = set()
        self._writes: list[tuple[Item, SwapHandle]] = []
        #: keys whose file matches the tensor in memory (read and not changed since)
        self._clean: set[str] = set()
        #: registered tensors (parameter shards): id -> (key, a weak reference to the tensor,
        #: so a later tensor that reuses a dead one's id is not taken for it)
        self._registered: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {}
        #: keys whose tensor is in use and must stay in memory (still written when asked)
        self._pinned: set[str] = set()

    def check_space(self, nbytes: int, key: str) -> None:
        """Refuse to start when the disk cannot take ``nbytes`` more for each process of this
        node that swaps there (``LOCAL_WORLD_SIZE``), before anything is overwritten."""
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        free = shutil.disk_usage(self.folder).free
        if nbytes * ranks > free:
            raise ValueError(
                f"{key}: {self.folder} has {free / 2**30:.2f} GiB free, and the optimizer "
                f"state swapped there needs about {nbytes * ranks / 2**30:.2f} GiB ({ranks} "
                "process(es) of this node): free some space or point nvme_path at a larger disk"
            )

    # -- registered tensors (parameter shards) ---------------------------------------------
    def register(self, key: str, tensor: torch.Tensor) -> None:
        """``tensor`` is swapped under ``key`` from now on (written out by :meth:`evict`)."""
        self._registered[id(tensor)] = (key, weakref.ref(tensor))

    def key_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._registered.get(id(tensor))
        return entry[0] if entry is not None and entry[1]() is tensor else None

    def fetch(self, key: str, tensor: torch.Tensor) -> None:
        """``tensor`` in memory (read back now if it is on disk)."""
        self.wait(self.start_fetch(key, tensor))

    def start_fetch(self, key: str, tensor: torch.Tensor) -> list[SwapHandle]:
        """Start reading ``tensor`` back if it is on disk; wait for the handles before use."""
        self.finish_writes()
        return self.start_reads([(key, tensor)])

    def evict(self, key: str, tensor: torch.Tensor) -> None:
        """``tensor`` out of memory: written first unless its file already holds it."""
        if key in self._clean and key in self._nbytes and _resident(tensor):
            tensor.untyped_storage().resize_(0)
            self._on_disk.add(key)
            self._clean.discard(key)
            return
        self.start_writes([(key, tensor)])
        self.finish_writes()

    def pin(self, key: str, pinned: bool) -> None:
        """While pinned, ``key``'s tensor is in use: writes keep it in memory."""
        if pinned:
            self._pinned.add(key)
        else:
            self._pinned.discard(key)

    def touch(self, keys: Sequence[str]) -> None:
        """The tensors of ``keys`` were changed in memory: their files are stale."""
        self._clean.difference_update(keys)

    # -- moving -----------------------------------------------------------------------------
    def start_reads(self, items: Sequence[Item]) -> list[SwapHandle]:
        """Give every swapped-out tensor of ``items`` its memory back and start reading it."""
        handles = []
        for key, tensor in items:
            if key in self._on_disk and not _resident(tensor):
                tensor.untyped_storage().resize_(self._nbytes[key])
                if tensor.device.type == "cpu":
                    handles.append(self.swapper.read(key, tensor))
                else:  # a device shard (one rank: the shard is the buffer): through the host
                    staging = torch.empty_like(tensor, device="cpu")
                    self.swapper.read(key, staging).wait()
                    tensor.copy_(staging)
                self._clean.add(key)
            self._on_disk.discard(key)
        return handles

    def start_writes(self, items: Sequence[Item]) -> None:
        """Start writing ``items`` out; their memory is freed by :meth:`finish_writes`."""
        for key, tensor in items:
            if not _resident(tensor):
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if self._nbytes.get(key) != nbytes:
                self.swapper.reserve(key, nbytes)  # a full disk fails here, before any write
                self._nbytes[key] = nbytes
            host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")  # device: staged
            self._writes.append(((key, tensor), self.swapper.write(key, host)))

    def finish_writes(self) -> None:
        """Wait for the writes in flight, then free their tensors' memory."""
        writes, self._writes = self._writes, []
        for _, handle in writes:
            handle.wait()
        for (key, tensor), _ in writes:
            if key in self._pinned:  # in use: the file now matches it, the memory stays
                self._clean.add(key)
                continue
            tensor.untyped_storage().resize_(0)
            self._on_disk.add(key)
            self._clean.discard(key)

    @staticmethod
    def wait(handles: Sequence[SwapHandle]) -> None:
        for handle in handles:
            handle.wait()

    @contextmanager
    def resident(self, items: Sequence[Item]) -> Iterator[None]:
        """``items`` in memory inside the block (checkpoints, inspection); those that were on
        disk are written back after it (a caller may have changed them)."""
        self.finish_writes()
        was_out = [(k, t) for k, t in items if k in self._on_disk]
        self.wait(self.start_reads(was_out))
        try:
            yield
        finally:
            self.touch([key for key, _ in was_out])
            self.start_writes(was_out)
            self.finish_writes()

    def forget(self) -> None:
        """The optimizer's state was replaced (a checkpoint loaded): no state is on disk."""
        self.finish_writes()
        shards = {key for key, _ in self._registered.values()}
        self._on_disk.intersection_update(shards)
        self._clean.intersection_update(shards)

    def close(self) -> None:
        self.finish_writes()
        self.swapper.close()
