"""Where a shard group's tensors live: the seam CPU/NVMe offload fills.

Today every tensor of a group lives on the accelerator that computes: parameters, gradients,
fp32 masters and optimizer state. ZeRO-Offload will give a group a placement whose masters and
optimizer state live in host memory or in files (:mod:`shardspeed.runtime.swap`), and the
group will move them through it; the engine never sees a placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """Devices of a shard group's tensors."""

    #: where parameters and gradients live and collectives run
    device: torch.device
    #: where the fp32 masters and the optimizer state live
    master_device: torch.device

    @classmethod
    def on(cls, device: torch.device) -> Placement:
        """Everything on ``device``."""
        return cls(device=device, master_device=device)
