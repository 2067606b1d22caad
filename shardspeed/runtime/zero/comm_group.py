"""A process group with this rank's place in it: what a shard group communicates over."""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.comm import ProcessGroup


@dataclass(frozen=True)
class CommGroup:
    """``group`` (None: the world), this rank's index in it and its size.

    MiCS shards over a subgroup and replicates the shards over the others (``replicated_over``).
    Mixture of Experts' expert parameters reduce over their expert-data-parallel group, yet each
    expert's gradient already sums the tokens its expert-parallel peers sent it: the average is
    over the whole data-parallel group (``average_over``), and the gradient norm adds the expert
    parameters the peers hold (``spread_over``, the expert-parallel group).
    """

    group: ProcessGroup | None
    rank: int
    world_size: int
    #: how many ranks' gradients the reduction averages (None: ``world_size``)
    average_over: int | None = None
    #: ranks holding other parameters of the same kind, whose gradient norms add to this one's
    spread_over: CommGroup | None = None
    #: what the parameters reducing over it are ("": the model's dense parameters; an expert
    #: group's name, ``ep_size_<n>``, for Mixture-of-Experts parameters)
    label: str = ""
    #: MiCS: the ranks holding the same shards in the other shard groups; reduced gradient
    #: shards are summed over them too (None: the shards exist once)
    replicated_over: CommGroup | None = None

    @property
    def partitioned(self) -> bool:
        """Whether splitting state over this group splits it at all."""
        return self.world_size > 1

    @property
    def reduces(self) -> bool:
        """Whether reducing gradients over this group changes them (other ranks, or an
        average over more ranks than the group has)."""
        return self.partitioned or self.divisor != 1

    @property
    def divisor(self) -> int:
        """What the summed gradients are divided by."""
        return self.world_size if self.average_over is None else self.average_over

    @classmethod
    def of(cls, group: ProcessGroup | None) -> CommGroup:
        """``group`` (None: the world) with this rank's place in it."""
        from shardspeed import comm

        return cls(group, comm.get_rank(group), comm.get_world_size(group))

    @classmethod
    def single(cls) -> CommGroup:
        """One rank alone (no collectives)."""
        return cls(group=None, rank=0, world_size=1)
