"""Where a shard group's tensors live: the seam CPU/NVMe offload fills.

Parameters and gradients live on the accelerator that computes; the fp32 masters and the
optimizer state live on ``master_device``: the same accelerator, or host memory under
ZeRO-Offload (:mod:`~shardspeed.runtime.zero.offload`), where NVMe offload also swaps them to
files between steps. The engine never sees a placement.
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
    #: the fraction of the masters (by elements, in bucket order) on ``master_device``; the
    #: rest stay on ``device`` (DeepSpeed's partial offload, ``offload_optimizer.ratio``)
    offload_ratio: float = 1.0
    #: whether ZeRO-Offload is on (also where host and device are one memory)
    offload: bool = False

    @classmethod
    def on(cls, device: torch.device) -> Placement:
        """Everything on ``device``."""
        return cls(device=device, master_device=device)

    def offloaded(self, sizes: list[int]) -> list[bool]:
        """Which of a group's masters (sizes in elements, bucket order) are offloaded: a
        prefix-first fill up to ``offload_ratio`` of the elements."""
        if not self.offload:
            return [False] * len(sizes)
        total, placed, chosen = sum(sizes), 0, []
        for size in sizes:
            fits = placed + size <= self.offload_ratio * total + 0.5
            chosen.append(fits)
            placed += size if fits else 0
        return chosen

    def master_devices(self, sizes: list[int]) -> list[torch.device]:
        """The device of each of a group's masters, given their sizes in elements."""
        return [self.master_device if o else self.device for o in self.offloaded(sizes)]
