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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardspeed.runtime.zero.placement import Placement

NONE, CPU, NVME = "none", "cpu", "nvme"


@dataclass(frozen=True)
class _OffloadSection:
    """What the two offload sections share: where to, the NVMe folder, pinned buffers."""

    device: str = NONE
    nvme_path: Path | None = None
    pin_memory: bool = False

    @staticmethod
    def _fields(section: Any) -> dict[str, Any]:
        return {
            "device": str(getattr(section.device, "value", section.device)),
            "nvme_path": section.nvme_path,
            "pin_memory": bool(section.pin_memory),
        }

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
    def from_config(cls, zero: Any) -> OptimizerOffload:
        section = getattr(zero, "offload_optimizer", None)
        if section is None:
            return cls()
        return cls(**cls._fields(section), ratio=float(section.ratio))

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

    def check(self, stage: int) -> None:
        """Refuse what cannot work, naming the fix (before anything is built)."""
        if not self.enabled:
            return
        if stage == 0:
            raise ValueError(
                f'zero_optimization.offload_optimizer.device="{self.device}" needs ZeRO stage 1, '
                "2 or 3 (the offloaded optimizer steps a partition); set zero_optimization.stage "
                'or set offload_optimizer.device to "none"'
            )
        if self.ratio < 1.0 and stage != 3:
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio={self.ratio} (partial offload) needs "
                f"ZeRO stage 3, as in DeepSpeed (this is stage {stage}); set the ratio to 1.0"
            )
        if self.to_nvme:
            check_nvme_path(self.nvme_path, "zero_optimization.offload_optimizer.nvme_path")


@dataclass(frozen=True)
class ParamOffload(_OffloadSection):
    """The ``offload_param`` section (ZeRO stage 3): where parameter shards live between
    uses. ``buffer_count``, ``buffer_size`` and ``max_in_cpu`` are accepted and not used: a
    shard is read straight into its own memory, which exists only while it is needed."""

    @classmethod
    def from_config(cls, zero: Any) -> ParamOffload:
        section = getattr(zero, "offload_param", None)
        return cls() if section is None else cls(**cls._fields(section))

    def check(self, stage: int) -> None:
        if not self.enabled:
            return
        if stage != 3:
            raise ValueError(
                f'zero_optimization.offload_param.device="{self.device}" needs ZeRO stage 3 (only '
                f"stage 3 partitions the parameters; this is stage {stage}); set "
                'zero_optimization.stage to 3 or offload_param.device to "none"'
            )
        if self.to_nvme:
            check_nvme_path(self.nvme_path, "zero_optimization.offload_param.nvme_path")


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
