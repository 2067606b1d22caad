"""MiCS (arXiv 2205.00119): ZeRO-3 sharding within groups of ``mics_shard_size`` ranks.

Parameters, gradients and optimizer state are split over a shard group of consecutive ranks and
replicated across the shard groups, so a parameter's all-gather stays inside the group (inside a
node, when the shard size is the node's GPU count) and only the reduced gradient shards cross
groups: a reduce-scatter inside the group, then an all-reduce of each shard over its replicas
(the ranks with the same position in the other groups), averaged over the whole world.
"""

from __future__ import annotations

import dataclasses

from shardspeed import comm
from shardspeed.comm.parallel_topology import ParallelTopology, current_topology
from shardspeed.runtime.zero.comm_group import CommGroup


def _sharded(topology: ParallelTopology, shard_size: int) -> ParallelTopology:
    dp = topology.size("dp")
    if shard_size < 1 or dp % shard_size:
        raise ValueError(
            f"zero_optimization.mics_shard_size={shard_size} must divide the data-parallel size "
            f"({dp}); choose one of {[d for d in range(1, dp + 1) if dp % d == 0]}"
        )
    return topology.with_dp_shard(shard_size)


def mics_comm(topology: ParallelTopology, shard_size: int) -> CommGroup:
    """This rank's shard group for ``zero_optimization.mics_shard_size``: groups of
    ``shard_size`` consecutive data-parallel ranks of ``topology``, replicated over the others
    (every rank calls it, in the same order)."""
    grid = _sharded(topology, shard_size)
    shards = CommGroup.of(grid.group("dp_shard"))
    replicas = CommGroup.of(grid.group("dp_replicate"))
    return dataclasses.replace(
        shards,
        average_over=topology.size("dp"),
        replicated_over=replicas if replicas.partitioned else None,
    )


def mics_process_group(shard_size: int, mpu: object = None) -> comm.ProcessGroup | None:
    """This rank's MiCS shard process group (``zero.MiCS_Init`` partitions over it): within the
    data-parallel axis of ``mpu``'s grid, else of the job's topology."""
    topology = current_topology()
    if mpu is not None and topology.mpu is not mpu:
        topology = ParallelTopology.from_mpu(mpu)
    return _sharded(topology, shard_size).group("dp_shard")
