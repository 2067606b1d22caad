"""``zero_optimization.offload_param`` / ``offload_optimizer``: where ZeRO keeps states."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
]


class OffloadDeviceEnum(str, Enum):
    """Offload target; compares equal to its string (``device == "cpu"``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"

    def __str__(self) -> str:
        return self.value


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    """``offload_param``: parameter offload to CPU or NVMe (ZeRO stage 3 only)."""

    json_key: ClassVar[str] = "zero_optimization.offload_param"

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """``none``, ``cpu`` or ``nvme``."""
    nvme_path: Path | None = None
    """NVMe filesystem path for parameter swapping."""
    buffer_count: int = Field(default=5, ge=0)
    """Buffers in the NVMe parameter buffer pool."""
    buffer_size: int = Field(default=100_000_000, ge=0)
    """Size of each NVMe parameter buffer, in elements."""
    max_in_cpu: int = Field(default=1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when offloading to NVMe."""
    pin_memory: bool = False
    """Use page-locked CPU memory (0.19.2 default False)."""

    @property
    def enabled(self) -> bool:
        """True unless ``device`` is ``none``."""
        return self.device != OffloadDeviceEnum.none


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    """``offload_optimizer``: optimizer-state offload to CPU or NVMe (ZeRO stages 1-3)."""

    json_key: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """``none``, ``cpu`` or ``nvme``; the optimizer step runs on CPU either way."""
    nvme_path: Path | None = None
    """NVMe filesystem path for optimizer-state swapping."""
    buffer_count: int = Field(default=4, ge=0)
    """NVMe buffers; at least the states per parameter (Adam: 4)."""
    pin_memory: bool = False
    """Use page-locked CPU memory (0.19.2 default False)."""
    pipeline_read: bool = False
    """Overlap reading the next tile with computing the current one."""
    pipeline_write: bool = False
    """Overlap writing the previous tile with computing the current one."""
    fast_init: bool = False
    """Fast optimizer initialization when offloading to NVMe."""
    ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of optimizer states offloaded to CPU Adam; below 1.0 needs ZeRO stage 3."""
    super_offload: bool = False
    """High-performance CPU offload for Superchips (ZeRO stage 3)."""
    cpuadam_cores_perc: float = Field(default=0.8, ge=0.0, le=1.0)
    """Fraction of CPU cores used by CPU Adam with ``super_offload``."""

    @property
    def enabled(self) -> bool:
        """True unless ``device`` is ``none``."""
        return self.device != OffloadDeviceEnum.none

    @property
    def pipeline(self) -> bool:
        """True when tiles are pipelined in either direction."""
        return self.pipeline_read or self.pipeline_write
