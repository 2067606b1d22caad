"""DeepSpeed's ``parallel_state_sp``: the model-parallel unit (``mpu``) of sequence parallelism.

:func:`initialize_sequence_parallel` makes the job's topology with a sequence-parallel axis
(consecutive ranks share one sequence, as in DeepSpeed; data parallelism over the rest) and
makes it current, so ``shardspeed.utils.groups`` and :func:`shardspeed.initialize` (given this
module as ``mpu``, it adopts :data:`parallel_topology` as is) answer from the same groups. The
"sequence data parallel" group, every rank that holds the same parameters, is what ZeRO shards
over and averages gradients over.
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm
from shardspeed.comm.group_caches import register_group_cache
from shardspeed.comm.parallel_topology import (
    ParallelTopology,
    current_topology,
    set_current_topology,
)

__all__ = [
    "initialize_sequence_parallel",
    "get_sequence_parallel_group",
    "get_sequence_parallel_world_size",
    "get_sequence_parallel_rank",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_world_size",
    "get_sequence_data_parallel_rank",
    "get_data_parallel_group",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
]

#: the topology :func:`initialize_sequence_parallel` made (read by ``shardspeed.initialize``);
#: forgotten with the process groups
parallel_topology: ParallelTopology | None = None


def _forget_topology() -> None:
    global parallel_topology
    parallel_topology = None


register_group_cache(_forget_topology)


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Split the world into groups of ``sequence_parallel_size`` consecutive ranks, each
    sharing one sequence (every rank calls it, after the process group is up)."""
    global parallel_topology
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int):
        raise TypeError(
            f"sequence_parallel_size must be an int, got {type(sequence_parallel_size).__name__}"
        )
    if sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
    if not comm.is_initialized():
        raise RuntimeError(
            "initialize_sequence_parallel needs the process group: call "
            "shardspeed.init_distributed() (or launch with the shardspeed launcher) first"
        )
    world = comm.get_world_size()
    if world % sequence_parallel_size:
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} does not divide the world size "
            f"{world}; launch a multiple of {sequence_parallel_size} ranks"
        )
    current = current_topology()
    if current.size("sp") == sequence_parallel_size and current is parallel_topology:
        return
    topology = ParallelTopology.build(sp=sequence_parallel_size)
    # build the groups now, in the same order on every rank
    for axes in (("sp",), ("dp", "sp"), ("dp",)):
        topology.group(*axes)
    topology.mpu = _this_module()
    topology.lent_axes = frozenset({"sp", "dp"})
    parallel_topology = topology
    set_current_topology(topology)


def _this_module() -> Any:
    import sys

    return sys.modules[__name__]


def _topology() -> ParallelTopology:
    if parallel_topology is None:
        raise RuntimeError(
            "sequence parallel groups are not initialized: call "
            "initialize_sequence_parallel(sequence_parallel_size) (or "
            "UlyssesSPAttentionHF.register_with_transformers) first"
        )
    return parallel_topology


def _group(*axes: str) -> Any:
    group = _topology().group(*axes)
    return comm.get_world_group() if group is None else group


def get_sequence_parallel_group() -> Any:
    """The ranks sharing this rank's sequence."""
    return _group("sp")


def get_sequence_parallel_world_size() -> int:
    return _topology().size("sp")


def get_sequence_parallel_rank() -> int:
    return _topology().local_rank("sp")


def get_sequence_data_parallel_group() -> Any:
    """Every rank holding the same parameters: ZeRO shards and averages over it."""
    return _group("dp", "sp")


def get_sequence_data_parallel_world_size() -> int:
    return _topology().size("dp", "sp")


def get_sequence_data_parallel_rank() -> int:
    return _topology().local_rank("dp", "sp")


def get_data_parallel_group() -> Any:
    """The ranks that read different batches."""
    return _group("dp")


def get_data_parallel_world_size() -> int:
    return _topology().size("dp")


def get_data_parallel_rank() -> int:
    return _topology().local_rank("dp")
