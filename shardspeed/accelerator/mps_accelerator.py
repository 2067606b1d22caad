"""The Apple-silicon backend through ``torch.mps``: one device, unified memory, gloo."""

from __future__ import annotations

from typing import Any

import psutil
import torch

from shardspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from shardspeed.accelerator.host_streams import HostStreamsMixin


class MPS_Accelerator(HostStreamsMixin, DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """A single Metal device.

    MPS exposes no user streams, so the stream API is the host no-op one, and its memory is the
    machine's unified memory, so pinning is a no-op. Peaks are sampled by this object (MPS keeps
    no peak counters), so they only see the values read through it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._name = "mps"
        self._communication_backend_name = "gloo"
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._bf16: bool | None = None

    # device and sync
    def device_name(self, device_index: int | None = None) -> str:
        return "mps" if device_index is None else f"mps:{device_index}"

    def set_device(self, device_index: int) -> None:
        """No-op: there is only one MPS device."""

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def synchronize(self, device_index: int | None = None) -> None:
        torch.mps.synchronize()

    # RNG
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.mps.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def initial_seed(self) -> int:
        # torch.mps keeps no initial seed of its own; seeding goes through the host generator
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # streams and events
    @property
    def Event(self) -> type:  # noqa: N802 - DeepSpeed's name
        return torch.mps.Event

    # memory
    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        now = int(torch.mps.current_allocated_memory())
        self._peak_allocated = max(self._peak_allocated, now)
        return now

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self.memory_allocated()
        return self._peak_allocated

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._peak_allocated = int(torch.mps.current_allocated_memory())

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return {
            "allocated_bytes.all.current": self.memory_allocated(),
            "allocated_bytes.all.peak": self.max_memory_allocated(),
            "reserved_bytes.all.current": self.memory_reserved(),
            "reserved_bytes.all.peak": self.max_memory_reserved(),
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated()
        self._peak_reserved = int(torch.mps.driver_allocated_memory())

    def memory_reserved(self, device_index: int | None = None) -> int:
        now = int(torch.mps.driver_allocated_memory())
        self._peak_reserved = max(self._peak_reserved, now)
        return now

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        self.memory_reserved()
        return self._peak_reserved

    def total_memory(self, device_index: int | None = None) -> int:
        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: int | None = None) -> int:
        budget = int(torch.mps.recommended_max_memory())
        return max(0, budget - int(torch.mps.driver_allocated_memory()))

    # dtypes and capabilities
    def is_bf16_supported(self) -> bool:
        if self._bf16 is None:
            # bf16 on MPS depends on the macOS version, so ask the device once
            try:
                torch.ones(1, dtype=torch.bfloat16, device="mps").add_(1)
                self._bf16 = True
            except (RuntimeError, TypeError):
                self._bf16 = False
        return self._bf16

    def is_fp16_supported(self) -> bool:
        return True

    def is_available(self) -> bool:
        return bool(torch.backends.mps.is_available())

    # pinning
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` unchanged: MPS shares memory with the host, so there is nothing to pin."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False
