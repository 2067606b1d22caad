"""Where a checkpoint's saved inputs live between forward and recompute.

A checkpointed block saves only its inputs. Three optional transformations shrink what stays on
the device, undone in reverse before the recompute:

1. *partitioning*: a floating-point input is flattened and split across the model-parallel
   group, each rank keeping ``ceil(numel / world)`` elements (the last share zero-padded), and
   all-gathered again for the recompute;
2. *contiguous buffer*: those partitions are copied into one preallocated flat buffer per input
   position with one slot per checkpoint (``number_checkpoints``), so that a forward's many
   small saved tensors do not fragment device memory;
3. *CPU checkpointing*: saved tensors are copied to (pinned, where a device exists) host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspeed import comm
from shardspeed.accelerator import get_accelerator

__all__ = [
    "ContiguousBuffers",
    "Placement",
    "StashedTensor",
    "contiguous_buffers",
    "restore_tensor",
    "stash_tensor",
]


@dataclass(frozen=True)
class Placement:
    """How one checkpoint's inputs are stored, fixed at its forward."""

    partition: bool = False
    cpu: bool = False
    contiguous: bool = False
    group: Any = None
    world_size: int = 1
    rank: int = 0


@dataclass(frozen=True)
class StashedTensor:
    """What is needed to turn a stored tensor back into the original input."""

    shape: torch.Size
    numel: int
    device: torch.device
    requires_grad: bool
    partitioned: bool
    offloaded: bool


def _partition_size(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def should_partition(tensor: torch.Tensor, placement: Placement) -> bool:
    """Partition only activations: floating point, with at least one element per rank. Alone
    in its group (no contiguous buffer to fill) a rank keeps the tensor as it is: a partition of
    one would only be a copy."""
    return (
        placement.partition
        and (placement.world_size > 1 or placement.contiguous)
        and tensor.is_floating_point()
        and tensor.numel() >= placement.world_size
    )


def partition_of(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's zero-padded share of ``tensor`` flattened: a fresh tensor, so the full
    activation's storage is not kept alive by a view."""
    flat = tensor.detach().reshape(-1)
    size = _partition_size(flat.numel(), world_size)
    start = rank * size
    piece = flat[start : start + size]
    out = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    out[: piece.numel()].copy_(piece)
    return out


def gather_partitions(
    part: torch.Tensor, numel: int, shape: torch.Size, placement: Placement
) -> torch.Tensor:
    """The full tensor from every rank's ``part`` (all-gathered over the model-parallel group)."""
    if placement.world_size == 1:
        return part[:numel].view(shape)
    full = torch.empty(part.numel() * placement.world_size, dtype=part.dtype, device=part.device)
    comm.all_gather_into_tensor(full, part.contiguous(), group=placement.group)
    return full[:numel].view(shape)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, pinned when there is a device to copy back to."""
    accel = get_accelerator()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    if tensor.device.type != "cpu":
        host = accel.pin_memory(host)
    host.copy_(tensor.detach(), non_blocking=False)
    return host


class ContiguousBuffers:
    """Preallocated flat buffers, one per (input position, dtype, device, partition size), each
    with ``num_slots`` slots; a checkpoint takes a slot per partitioned input in forward and
    gives it back after its recompute."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._free: dict[tuple[Any, ...], list[int]] = {}
        # the settings generation these buffers were sized under (see function.py)
        self.sized_for = -1
        # bumped by every clear(): a slot handed out before must never come back into new
        # buffers
        self._epoch = 0

    def clear(self) -> None:
        """Drop every buffer (their memory goes back when no checkpoint still uses a slot)."""
        self._buffers.clear()
        self._free.clear()
        self._epoch += 1

    def allocated_bytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def store(
        self, position: int, part: torch.Tensor, num_slots: int, device: torch.device
    ) -> tuple[torch.Tensor, tuple[tuple[Any, ...], int, int]]:
        """Copy ``part`` into a free slot; returns the slot's view and the handle to release."""
        key = (position, part.dtype, device, part.numel())
        if key not in self._buffers:
            buffer = torch.empty(num_slots * part.numel(), dtype=part.dtype, device=device)
            if device.type == "cpu" and get_accelerator().device_name() != "cpu":
                buffer = get_accelerator().pin_memory(buffer)
            self._buffers[key] = buffer
            # slots are handed out lowest first so a forward fills the buffer front to back
            self._free[key] = list(range(num_slots - 1, -1, -1))
        if not self._free[key]:
            raise RuntimeError(
                f"the contiguous activation-checkpoint buffer for input {position} is full "
                f"({num_slots} checkpoints): raise activation_checkpointing.number_checkpoints "
                "to the number of checkpoint() calls per forward, or call "
                "shardspeed.checkpointing.reset() after forwards that run no backward."
            )
        slot = self._free[key].pop()
        size = part.numel()
        buffer = self._buffers[key]
        # A narrow() view would share the buffer's version counter: writing the next slot would
        # then look to autograd like an in-place change of this one. A tensor set onto the same
        # storage has its own counter.
        view = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
        view.set_(buffer.untyped_storage(), buffer.storage_offset() + slot * size, (size,), (1,))
        view.copy_(part)
        return view, (key, slot, self._epoch)

    def release(self, handle: tuple[tuple[Any, ...], int, int]) -> None:
        """Give a slot back (ignored when the buffers were cleared or resized since it was
        taken: the slot belongs to a buffer that no longer exists)."""
        key, slot, epoch = handle
        if epoch == self._epoch and key in self._free:
            self._free[key].append(slot)


_BUFFERS = ContiguousBuffers()


def contiguous_buffers() -> ContiguousBuffers:
    """The process-wide contiguous buffers."""
    return _BUFFERS


def stash_tensor(
    tensor: torch.Tensor, position: int, placement: Placement, num_slots: int | None
) -> tuple[torch.Tensor, StashedTensor, Any]:
    """What to save for input ``tensor``: ``(stored, info, slot_handle_or_None)``."""
    info = StashedTensor(
        shape=tensor.shape,
        numel=tensor.numel(),
        device=tensor.device,
        requires_grad=tensor.requires_grad,
        partitioned=should_partition(tensor, placement),
        offloaded=placement.cpu,
    )
    stored = tensor.detach()
    handle = None
    if info.partitioned:
        stored = partition_of(stored, placement.rank, placement.world_size)
        if placement.contiguous:
            assert num_slots is not None, "configure() checks number_checkpoints"
            where = torch.device("cpu") if placement.cpu else stored.device
            stored, handle = _BUFFERS.store(position, stored, num_slots, where)
            return stored, info, handle
    if placement.cpu and stored.device.type != "cpu":
        # a tensor already in host memory (a host-only machine) is kept as it is
        stored = to_host(stored)
    return stored, info, handle


def restore_tensor(stored: torch.Tensor, info: StashedTensor, placement: Placement) -> torch.Tensor:
    """The input as it was in forward, detached, on its device, ``requires_grad`` as it was."""
    tensor = stored
    if tensor.device != info.device:
        tensor = tensor.to(info.device, non_blocking=True)
    if info.partitioned:
        tensor = gather_partitions(tensor, info.numel, info.shape, placement)
    tensor = tensor.detach()
    tensor.requires_grad_(info.requires_grad)
    return tensor
