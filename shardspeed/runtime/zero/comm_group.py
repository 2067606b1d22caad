"""A process group with this rank's place in it: what a shard group communicates over, and the
collectives the ZeRO buffers run over it.

The buffers (flat shards, gradient buckets, replicated groups) never call ``shardspeed.comm``
themselves: they ask their group to all-gather, reduce-scatter, all-reduce or broadcast. That
is where a group that communicates differently plugs in: MiCS's reduce-scatter is followed by
an all-reduce over the replica groups here (:meth:`CommGroup.reduce_scatter`), and quantized or
hierarchical collectives (ZeRO++) are the same four verbs on another group.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardspeed import comm
from shardspeed.comm import ProcessGroup
from shardspeed.comm.instrument import DeferredWork
from shardspeed.runtime.comm.quantize import QuantSpec, dequantize, quantize
from shardspeed.runtime.comm.quantized_reduce import ErrorFeedback, Level, quantized_reduce_scatter

if TYPE_CHECKING:
    from shardspeed.runtime.zero.zeropp import ZeroPP


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
    #: ZeRO++ (stage 3): which of this group's collectives are quantized or hierarchical
    #: (None: none)
    zeropp: ZeroPP | None = None

    @property
    def partitioned(self) -> bool:
        """Whether splitting state over this group splits it at all."""
        return self.world_size > 1

    @property
    def alone(self) -> bool:
        """Whether this rank is the only holder of its state: a group of one rank with no
        replicas, over which every reduce-scatter and all-gather hands back its input."""
        return self.world_size == 1 and (
            self.replicated_over is None or self.replicated_over.world_size == 1
        )

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
        return cls(group, comm.get_rank(group), comm.get_world_size(group))

    @classmethod
    def single(cls) -> CommGroup:
        """One rank alone (no collectives)."""
        return cls(group=None, rank=0, world_size=1)

    # -- collectives ------------------------------------------------------------------------
    def global_rank(self, member: int = 0) -> int:
        """The global rank of the group's ``member``-th rank."""
        return comm.get_global_rank(self.group, member) if self.group is not None else member

    def broadcast(self, tensor: torch.Tensor, member: int = 0) -> None:
        """Every rank's ``tensor`` becomes member ``member``'s (nothing to do alone)."""
        if self.partitioned:
            comm.broadcast(tensor, src=self.global_rank(member), group=self.group)

    def all_gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        async_op: bool = False,
        spec: QuantSpec | None = None,
    ) -> Any:
        """Concatenate every rank's ``shard`` into ``output`` in group-rank order; with
        ``spec`` (ZeRO++ qwZ) each rank sends its shard quantized
        (:meth:`all_gather_payload`)."""
        if spec is None:
            return comm.all_gather_into_tensor(output, shard, group=self.group, async_op=async_op)
        return self.all_gather_payload(output, quantize(shard, spec), spec, async_op)

    def all_gather_payload(
        self, output: torch.Tensor, payload: torch.Tensor, spec: QuantSpec, async_op: bool = False
    ) -> Any:
        """All-gather every rank's quantized ``payload`` (``spec``'s ``uint8`` scales and codes
        of its ``output.numel() / world_size`` elements) in one collective and dequantize each
        rank's part, this rank's own included (every rank then holds the same values), into
        ``output`` (when waited for, if ``async_op``)."""
        chunk = output.numel() // self.world_size
        gathered = payload.new_empty(payload.numel() * self.world_size)
        work = comm.all_gather_into_tensor(gathered, payload, group=self.group, async_op=async_op)

        def unpack() -> None:
            parts = gathered.view(self.world_size, -1)
            for member in range(self.world_size):
                dequantize(
                    parts[member], chunk, spec, out=output[chunk * member : chunk * (member + 1)]
                )

        if not async_op:
            unpack()
            return None
        return DeferredWork(work, unpack)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, async_op: bool = False) -> Any:
        """Reduce ``tensor`` in place over the group (sum by default)."""
        op = comm.ReduceOp.SUM if op is None else op
        return comm.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        source: torch.Tensor,
        async_op: bool = False,
        key: Hashable | None = None,
    ) -> Any:
        """Sum ``source`` over the ranks holding this shard and leave this rank's part in
        ``output``: the group's reduce-scatter, then (MiCS) an all-reduce of the part over
        the replicas holding the same shard in the other groups. With ZeRO++'s qgZ the
        reduce-scatter is quantized all-to-alls instead, LoCo's error buffers kept under
        ``key`` (a name stable across steps, e.g. the gradient bucket's index)."""
        if self.zeropp is not None and self.zeropp.quantized_gradients:
            self._quantized_reduce_scatter(output, source, key)
            work: Any = DeferredWork(None) if async_op else None  # ran to completion
        else:
            work = comm.reduce_scatter_tensor(output, source, group=self.group, async_op=async_op)
        replicas = self.replicated_over
        if replicas is None:
            return work
        if not async_op:
            replicas.all_reduce(output)
            return None
        return DeferredWork(work, lambda: replicas.all_reduce(output))

    def _quantized_reduce_scatter(
        self, output: torch.Tensor, source: torch.Tensor, key: Hashable | None
    ) -> None:
        """qgZ: the reduce-scatter as one quantized all-to-all per level (the node group,
        then the same place in the other nodes; or the whole group), run to completion."""
        zeropp = self.zeropp
        assert zeropp is not None
        if zeropp.local is None or zeropp.cross is None:
            levels = [Level(self.group, self.world_size)]
        else:
            local, cross = zeropp.local, zeropp.cross
            # the levels' mixed-radix numbering must be this group's own
            assert self.rank == cross.rank * local.world_size + local.rank
            levels = [Level(local.group, local.world_size), Level(cross.group, cross.world_size)]
        feedback = None
        if zeropp.loco is not None:
            assert key is not None, "LoCo keeps its error buffers under the reduction's key"
            feedback = zeropp.errors.get(key)
            if feedback is None:
                feedback = zeropp.errors[key] = ErrorFeedback(
                    zeropp.loco.err_beta, zeropp.loco.reset_t
                )
        quantized_reduce_scatter(output, source, levels, feedback=feedback)
