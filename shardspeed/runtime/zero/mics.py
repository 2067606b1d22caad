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
from shardspeed.runtime.zero.comm_group import CommGroup

#: (world group, shard size) -> the grid, made once per process group (its groups are collective)
_GRIDS: dict[tuple[int, int], comm.Topology] = {}


def _grid(shard_size: int) -> comm.Topology:
    key = (id(comm.get_world_group()), shard_size)
    if key not in _GRIDS:
        world = comm.get_world_size()
        _GRIDS[key] = comm.Topology(
            axes={"mics_replica": world // shard_size, "mics_shard": shard_size}
        )
    return _GRIDS[key]


def mics_comm(data_parallel: CommGroup, shard_size: int) -> CommGroup:
    """The shard group of this rank for ``zero_optimization.mics_shard_size`` (every rank calls
    it, in the same order)."""
    world = comm.get_world_size()
    if data_parallel.world_size != world:
        raise NotImplementedError(
            "zero_optimization.mics_shard_size needs the data-parallel group to be the whole "
            f"world (here {data_parallel.world_size} of {world} ranks: pipeline or model "
            "parallelism is in use); remove mics_shard_size"
        )
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"zero_optimization.mics_shard_size={shard_size} must divide the world size "
            f"({world}); choose one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    grid = _grid(shard_size)
    shards = CommGroup.of(grid.get_group("mics_shard"))
    replicas = CommGroup.of(grid.get_group("mics_replica"))
    return dataclasses.replace(
        shards, average_over=world, replicated_over=replicas if replicas.partitioned else None
    )


def mics_process_group(shard_size: int) -> comm.ProcessGroup | None:
    """This rank's MiCS shard process group (``zero.MiCS_Init`` partitions over it)."""
    return _grid(shard_size).get_group("mics_shard")
