"""The CPU backend: host memory, host clocks, gloo."""

from __future__ import annotations

import os
from typing import Any

import torch

from shardspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from shardspeed.accelerator.host_memory import HostMemoryTracker
from shardspeed.accelerator.host_streams import HostEvent, HostStreamsMixin


class CPU_Accelerator(HostStreamsMixin, DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """Runs everything on the host.

    ``device_count()`` is the number of ranks sharing this machine: ``device_count`` given to the
    constructor, else ``LOCAL_SIZE`` (what DeepSpeed's CPU accelerator reads), else
    ``LOCAL_WORLD_SIZE`` (set by torchrun and the shardspeed launcher), else 1.
    Each rank then treats "its" CPU device index as its local rank, which is what launchers and
    tests that reason about devices per node expect.
    """

    def __init__(self, device_count: int | None = None) -> None:
        super().__init__()
        self._name = "cpu"
        self._communication_backend_name = "gloo"
        self._device_count = device_count
        self._current_device = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self._memory = HostMemoryTracker()

    # device and sync
    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        # every CPU "device" is the same torch device; the index only names the rank's slot
        return "cpu"

    def set_device(self, device_index: int) -> None:
        self._current_device = int(device_index)

    def current_device(self) -> int:
        return self._current_device

    def device_count(self) -> int:
        if self._device_count is not None:
            return self._device_count
        for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            value = int(os.environ.get(var, "0") or 0)
            if value > 0:
                return value
        return 1

    def synchronize(self, device_index: int | None = None) -> None:
        """No-op: CPU ops have finished when they return."""

    # RNG
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # streams and events
    @property
    def Event(self) -> type:  # noqa: N802 - DeepSpeed's name
        return HostEvent

    # memory
    def empty_cache(self) -> None:
        """No-op: the CPU allocator keeps no cache shardspeed could release."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory.current()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory.peak()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._memory.reset_peak()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        current, peak = self._memory.current(), self._memory.peak()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._memory.reset_peak()

    def memory_reserved(self, device_index: int | None = None) -> int:
        # RSS is both what is used and what is held: there is no separate cache to count
        return self._memory.current()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory.peak()

    def total_memory(self, device_index: int | None = None) -> int:
        return self._memory.total()

    def available_memory(self, device_index: int | None = None) -> int:
        return self._memory.available()

    # dtypes and capabilities
    def is_bf16_supported(self) -> bool:
        """True: torch implements bfloat16 on CPU (fast only where the CPU has AVX512-BF16/AMX)."""
        return True

    def is_fp16_supported(self) -> bool:
        """True: torch implements float16 on CPU, though often slower than float32."""
        return True

    def is_available(self) -> bool:
        return True

    # pinning
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` unchanged: pinning only speeds up copies to a device, and there is none."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        try:
            return bool(tensor.is_pinned())
        except RuntimeError:
            # CPU-only builds may refuse to query pinning at all
            return False
