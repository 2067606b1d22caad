"""A process group with this rank's place in it: what a shard group communicates over."""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.comm import ProcessGroup


@dataclass(frozen=True)
class CommGroup:
    """``group`` (None: the world), this rank's index in it and its size."""

    group: ProcessGroup | None
    rank: int
    world_size: int

    @property
    def partitioned(self) -> bool:
        """Whether splitting state over this group splits it at all."""
        return self.world_size > 1

    @classmethod
    def single(cls) -> CommGroup:
        """One rank alone (no collectives)."""
        return cls(group=None, rank=0, world_size=1)
