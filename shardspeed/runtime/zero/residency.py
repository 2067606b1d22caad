"""Where a ZeRO-3 shard lives between uses: device memory, host memory, or a file.

A :class:`~shardspeed.runtime.zero.flat_shard.FlatShard` is given one residency and calls the
same verbs whatever it is; it never asks which kind it has:

* :meth:`Residency.adopt` moves the shard to where it lives (once, when offloading starts; a
  shard that is the whole buffer, with one rank, stays where the buffer is);
* :meth:`Residency.fetch` / :meth:`Residency.start_fetch` bring its values into memory (a
  file's read can run while other work goes on), :meth:`Residency.evict` lets them go again;
* :meth:`Residency.changed` marks the values written (a file is rewritten only then);
* :meth:`Residency.pin` keeps a shard that is the whole buffer in memory while it is in use.

On the device and in host memory the values never leave: those verbs do nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from shardspeed.runtime.zero.state_swap import SwapStore


class Residency:
    """The shard stays in device memory (no ``offload_param``)."""

    #: whether the shard's values leave memory between uses
    swapped: ClassVar[bool] = False

    def adopt(self, shard: torch.Tensor, movable: bool) -> torch.Tensor:
        """The shard where it lives from now on (moved only if ``movable``)."""
        return shard

    def fetch(self, shard: torch.Tensor) -> None:
        """Make ``shard``'s values present."""

    def start_fetch(self, shard: torch.Tensor) -> Sequence[Any]:
        """Start making ``shard``'s values present; returns handles to wait for."""
        return []

    def evict(self, shard: torch.Tensor) -> None:
        """``shard``'s values may leave memory now."""

    def changed(self) -> None:
        """The shard's values were written."""

    def pin(self, in_use: bool) -> None:
        """Keep (or stop keeping) the values in memory while the shard is in use."""

    def source(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``shard`` on ``device`` for a collective (a copy when it lives elsewhere)."""
        return shard if shard.device == device else shard.to(device)


ON_DEVICE = Residency()


class HostResidency(Residency):
    """``offload_param.device: cpu``: the shard lives in host memory; a device copy is made
    for each all-gather."""

    def __init__(self, host: torch.device) -> None:
        self.host = host

    def adopt(self, shard: torch.Tensor, movable: bool) -> torch.Tensor:
        return shard.to(self.host) if movable and shard.device != self.host else shard


class FileResidency(Residency):
    """``offload_param.device: nvme``: the shard's values live in ``store``'s file ``key``,
    read back before each gather and let go as soon as it is done (written only if changed)."""

    swapped: ClassVar[bool] = True

    def __init__(self, store: SwapStore, key: str, host: torch.device | None = None) -> None:
        self.store, self.key, self.host = store, key, host

    def adopt(self, shard: torch.Tensor, movable: bool) -> torch.Tensor:
        if movable and self.host is not None and shard.device != self.host:
            shard = shard.to(self.host)
        self.store.register(self.key, shard)
        return shard

    def fetch(self, shard: torch.Tensor) -> None:
        self.store.fetch(self.key, shard)

    def start_fetch(self, shard: torch.Tensor) -> Sequence[Any]:
        return self.store.start_fetch(self.key, shard)

    def evict(self, shard: torch.Tensor) -> None:
        self.store.evict(self.key, shard)

    def changed(self) -> None:
        self.store.touch([self.key])

    def pin(self, in_use: bool) -> None:
        self.store.pin(self.key, in_use)


def residency_for(host: torch.device | None, store: SwapStore | None, key: str) -> Residency:
    """The residency ``offload_param`` asks for: a file in ``store`` (under ``key``), else
    ``host`` memory, else the device."""
    if store is not None:
        return FileResidency(store, key, host)
    if host is not None:
        return HostResidency(host)
    return ON_DEVICE
