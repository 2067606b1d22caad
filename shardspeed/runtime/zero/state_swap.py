"""ZeRO-Infinity's optimizer-state swapping: ``offload_optimizer.device: nvme``.

Between steps the optimizer state of the offloaded masters (Adam's ``exp_avg`` and
``exp_avg_sq``, every state tensor the size of its master) lives in files under ``nvme_path``
and holds no memory. The step runs ``sub_group_size`` elements at a time: the state of sub-group
``k+1`` is read while ``k`` steps, and ``k``'s is written back behind it, so at most three
sub-groups' state is in memory at once. Each file is preallocated before its first write, so a
full disk is found before any state is overwritten; a failed read or write stops the step with
the file named, and the state on disk stays the last complete one.

The masters stay in memory: with fp32 parameters they are the parameters' own partition (no
copy anywhere); with fp16/bf16 parameters the fp32 copies stay in host memory.
"""

from __future__ import annotations

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


class OptimizerStateSwap:
    """Keeps optimizer state tensors in files between steps, one file per (master, state)."""

    def __init__(self, folder: Path, rank: int, aio: Any = None, pin_memory: bool = False) -> None:
        self.folder = Path(folder) / f"optimizer_rank{rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        from shardspeed.runtime.swap.swapper import TensorSwapper

        self.swapper = TensorSwapper(self.folder, aio, pin_memory=pin_memory)
        #: bytes of each file written so far (reserved before its first write)
        self._nbytes: dict[str, int] = {}
        #: keys whose file holds the current value of a tensor with no memory now
        self._on_disk: set[str] = set()
        self._writes: list[tuple[Item, SwapHandle]] = []

    @staticmethod
    def items(optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor]) -> list[Item]:
        """The state tensors of ``masters`` that are as large as their master (scalars such as
        ``step`` stay), keyed by the master's position and the state's name."""
        found: list[Item] = []
        for index, master in enumerate(masters):
            for name, value in sorted(optimizer.state.get(master, {}).items()):
                if isinstance(value, torch.Tensor) and value.numel() == master.numel() > 1:
                    found.append((f"master{index}_{name}", value))
        return found

    # -- moving -----------------------------------------------------------------------------
    def start_reads(self, items: Sequence[Item]) -> list[SwapHandle]:
        """Give every swapped-out tensor of ``items`` its memory back and start reading it."""
        handles = []
        for key, tensor in items:
            if key in self._on_disk and not _resident(tensor):
                tensor.untyped_storage().resize_(self._nbytes[key])
                handles.append(self.swapper.read(key, tensor))
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
            self._writes.append(((key, tensor), self.swapper.write(key, tensor)))

    def finish_writes(self) -> None:
        """Wait for the writes in flight, then free their tensors' memory."""
        writes, self._writes = self._writes, []
        for _, handle in writes:
            handle.wait()
        for (key, tensor), _ in writes:
            tensor.untyped_storage().resize_(0)
            self._on_disk.add(key)

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
            self.start_writes(was_out)
            self.finish_writes()

    def forget(self) -> None:
        """The optimizer's state was replaced (a checkpoint loaded): nothing is on disk."""
        self.finish_writes()
        self._on_disk.clear()

    def close(self) -> None:
        self.finish_writes()
        self.swapper.close()
