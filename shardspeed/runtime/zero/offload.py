"""ZeRO-Offload: where the optimizer's tensors live (``zero_optimization.offload_optimizer``).

With ``device: cpu`` the fp32 masters, their gradients and the optimizer state live in host
memory and the optimizer (``DeepSpeedCPUAdam`` and friends) steps there; the updated values go
back into the parameters on the accelerator. With ``device: nvme`` they live in host memory
only while their sub-group steps (``sub_group_size`` elements at a time) and in files under
``nvme_path`` otherwise (:mod:`~shardspeed.runtime.zero.state_swap`). ``ratio`` offloads only
that fraction of the masters (by elements, in bucket order); the rest step on the accelerator.

On a machine whose accelerator is the CPU, host and device are one memory: ``cpu`` then moves
nothing (and copies nothing: a master that is the parameter chunk itself stays so), and
``nvme`` is what takes the optimizer state out of the training process's memory.

Which stages may offload what is a rule of :mod:`~shardspeed.runtime.zero.rules`; here only the
folders are checked (:func:`check_offload_folders`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shardspeed.config.offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from shardspeed.config.zero import DeepSpeedZeroConfig
from shardspeed.runtime.zero.placement import Placement

NONE, CPU, NVME = "none", "cpu", "nvme"


@dataclass(frozen=True)
class _OffloadSection:
    """What the two offload sections share: where to, the NVMe folder, pinned buffers."""

    device: str = NONE
    nvme_path: Path | None = None
    pin_memory: bool = False

    @property
    def enabled(self) -> bool:
        return self.device != NONE

    @property
    def to_nvme(self) -> bool:
        return self.device == NVME


@dataclass(frozen=True)
class OptimizerOffload(_OffloadSection):
    """The ``offload_optimizer`` section, as the ZeRO layer uses it."""

    ratio: float = 1.0

    @classmethod
    def from_section(cls, section: DeepSpeedZeroOffloadOptimizerConfig | None) -> OptimizerOffload:
        if section is None:
            return cls()
        return cls(
            device=section.device.value,
            nvme_path=section.nvme_path,
            pin_memory=bool(section.pin_memory),
            ratio=float(section.ratio),
        )

    def placement(self, device: torch.device) -> Placement:
        """Where a shard group's tensors live under this offload."""
        if not self.enabled:
            return Placement.on(device)
        return Placement(
            device=device,
            master_device=torch.device("cpu"),
            offload_ratio=self.ratio,
            offload=True,
        )


@dataclass(frozen=True)
class ParamOffload(_OffloadSection):
    """The ``offload_param`` section (ZeRO stage 3): where parameter shards live between
    uses. ``buffer_count``, ``buffer_size`` and ``max_in_cpu`` are accepted and not used: a
    shard is read straight into its own memory, which exists only while it is needed."""

    @classmethod
    def from_section(cls, section: DeepSpeedZeroOffloadParamConfig | None) -> ParamOffload:
        if section is None:
            return cls()
        return cls(
            device=section.device.value,
            nvme_path=section.nvme_path,
            pin_memory=bool(section.pin_memory),
        )


def check_offload_folders(zero: DeepSpeedZeroConfig) -> None:
    """Refuse an NVMe offload whose ``nvme_path`` is missing, not a folder or not writable
    (at initialize, on the rank that will write there)."""
    sections = (
        ("offload_param", zero.offload_param),
        ("offload_optimizer", zero.offload_optimizer),
    )
    for key, section in sections:
        if section is not None and section.device.value == NVME:
            check_nvme_path(section.nvme_path, f"zero_optimization.{key}.nvme_path")


def check_nvme_path(path: Path | None, key: str) -> Path:
    """``path`` as a writable folder, or an error naming ``key`` and the fix."""
    if path is None:
        raise ValueError(f'{key} is required with device "nvme": give a folder on a fast disk')
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{key}={str(folder)!r} is not an existing folder; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{key}={str(folder)!r} is not writable by this process")
    return folder
