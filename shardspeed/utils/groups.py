"""DeepSpeed's ``deepspeed.utils.groups``: which process group each parallel axis uses.

Every answer comes from the job's :class:`~shardspeed.comm.parallel_topology.ParallelTopology`
(:func:`~shardspeed.comm.parallel_topology.current_topology`): the one
:func:`shardspeed.initialize` built, or :func:`initialize` here. A model-parallel unit (``mpu``,
Megatron's interface) given to either places the ranks and lends its groups to that topology;
without one every rank is data parallel and the model- and sequence-parallel axes have size 1
(asking for such a group is then an error that says so). Hugging Face Transformers and
Accelerate ask this module for the data-, model- and sequence-parallel sizes.

Expert parallelism (Mixture of Experts) splits the topology's data-parallel axis
(:meth:`~shardspeed.comm.parallel_topology.ParallelTopology.expert_mesh`): its groups are made
by :func:`_create_expert_and_data_parallel`, once per ``ep_size``, and named ``ep_size_<n>`` as
in DeepSpeed: an ``ep`` axis (the ranks that split one layer's experts between them) and an
``edp`` axis (the ranks holding the same experts, over which their gradients are reduced). The
expert-parallel ranks are consecutive by default; ``use_data_before_expert_parallel_`` puts the
data-parallel ranks together instead.
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm
from shardspeed.comm.mesh import Mesh
from shardspeed.comm.parallel_topology import (
    ParallelTopology,
    current_topology,
    set_current_topology,
)

__all__ = ["initialize", "get_mpu"]


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Make the job's topology from ``mpu`` (``None``: every rank data parallel; the groups
    the topology had are forgotten) and the expert-parallel groups of ``ep_size`` (> 1; those
    of 1 are made by the first MoE layer). With an ``mpu`` or ``ep_size`` > 1 every rank
    calls it."""
    if mpu is None:
        set_current_topology(None)
    else:
        comm.get_world_size()  # a clear error without a process group
        topology = ParallelTopology.from_mpu(mpu)
        topology.mpu = mpu
        set_current_topology(topology)
    if ep_size > 1:
        _create_expert_and_data_parallel(ep_size)


def get_mpu() -> Any:
    """The model-parallel unit the current topology was made from, or ``None``."""
    return getattr(current_topology(), "mpu", None)


def _axis_group(axis: str) -> Any:
    group = current_topology().group(axis)
    return comm.get_world_group() if group is None else group


def _get_data_parallel_group() -> Any:
    """The data-parallel group (the world group when every rank is data parallel)."""
    return _axis_group("dp")


def _get_data_parallel_world_size() -> int:
    return current_topology().size("dp")


def _get_data_parallel_rank() -> int:
    return current_topology().local_rank("dp")


def _has_axis(axis: str) -> bool:
    """Whether the topology has a group for ``axis``: more than one rank on it, or an mpu
    that lends the group (of one rank)."""
    topology = current_topology()
    return topology.size(axis) > 1 or axis in topology.lent_axes


def _get_model_parallel_group() -> Any:
    """The tensor-parallel group; without model parallelism there is none (an error says so)."""
    if not _has_axis("tp"):
        raise RuntimeError(
            "no model-parallel group: no mpu was given (deepspeed.initialize(mpu=...) or "
            "groups.initialize(mpu=...)), so the model-parallel size is 1"
        )
    return _axis_group("tp")


def _get_model_parallel_world_size() -> int:
    return current_topology().size("tp")


def _get_model_parallel_rank() -> int:
    return current_topology().local_rank("tp")


def _get_sequence_parallel_group() -> Any:
    """The sequence-parallel group; without sequence parallelism there is none (an error says
    so)."""
    if not _has_axis("sp"):
        raise RuntimeError(
            "no sequence-parallel group: the job's topology has no sequence-parallel axis "
            "(no mpu providing get_sequence_parallel_group was given); the sequence-parallel "
            "size is 1"
        )
    return _axis_group("sp")


def _get_sequence_parallel_world_size() -> int:
    return current_topology().size("sp")


def _get_sequence_parallel_rank() -> int:
    return current_topology().local_rank("sp")


def _get_sequence_data_parallel_group() -> Any:
    """Sequence and data parallel together."""
    group = current_topology().group("dp", "sp")
    return comm.get_world_group() if group is None else group


def _get_sequence_data_parallel_world_size() -> int:
    return current_topology().size("dp", "sp")


def _get_sequence_data_parallel_rank() -> int:
    return current_topology().local_rank("dp", "sp")


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of ``ep_size``."""
    return f"ep_size_{ep_size}"


def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    """Make the expert-parallel and expert-data-parallel groups of ``expert_parallel_size_``
    (every rank calls it; a second call with the same size does nothing).

    With D data-parallel ranks and ep_size E: D/E expert-parallel groups of E ranks each split
    every MoE layer's experts, and E expert-data-parallel groups of D/E ranks each hold the
    same experts. Default order: expert-parallel ranks consecutive (``[0, 1]``, ``[2, 3]`` for
    D=4, E=2); ``use_data_before_expert_parallel_``: expert-data-parallel ranks consecutive.
    """
    comm.get_world_size()  # a clear error without a process group
    ep_size = int(expert_parallel_size_)
    topology = current_topology()
    if _named_expert_mesh(expert_group_name(ep_size)) is not None:
        return
    if topology.size("tp") > 1 or topology.size("sp") > 1:
        raise NotImplementedError(
            "expert parallelism together with model or sequence parallelism (an mpu with more "
            "than one rank on those axes) is not supported by shardspeed; use data and expert "
            "parallelism only"
        )
    mesh = topology.expert_mesh(ep_size, bool(use_data_before_expert_parallel_))
    mesh.group("ep")  # every rank makes every group now, in the same order
    mesh.group("edp")


def _named_expert_mesh(group_name: str) -> Mesh | None:
    for (ep_size, _), mesh in current_topology().expert_meshes().items():
        if expert_group_name(ep_size) == group_name:
            return mesh
    return None


def _expert_mesh(group_name: str) -> Mesh:
    mesh = _named_expert_mesh(group_name)
    if mesh is None:
        made = sorted(expert_group_name(e) for e, _ in current_topology().expert_meshes())
        raise RuntimeError(
            f"no expert-parallel groups named {group_name!r} (made so far: {made or 'none'}); "
            "they are made by deepspeed.initialize for the MoE layers of the model, or by "
            "groups._create_expert_and_data_parallel(ep_size)"
        )
    return mesh


def _group_or_world(mesh: Mesh, axis: str) -> Any:
    group = mesh.group(axis)
    return comm.get_world_group() if group is None else group


def _get_expert_parallel_group(group_name: str) -> Any:
    """The process group splitting the experts of the layers named ``group_name``."""
    return _group_or_world(_expert_mesh(group_name), "ep")


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {
        expert_group_name(e): _group_or_world(m, "ep")
        for (e, _), m in current_topology().expert_meshes().items()
    }


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """The process group over which the experts of ``group_name`` reduce their gradients."""
    return _group_or_world(_expert_mesh(group_name), "edp")


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {
        expert_group_name(e): _group_or_world(m, "edp")
        for (e, _), m in current_topology().expert_meshes().items()
    }


def _get_expert_parallel_ranks(group_name: str) -> list[int]:
    """Global ranks of this rank's expert-parallel group."""
    return _expert_mesh(group_name).ranks("ep")


def _get_expert_data_parallel_ranks(group_name: str) -> list[int]:
    """Global ranks of this rank's expert-data-parallel group."""
    return _expert_mesh(group_name).ranks("edp")


def _get_expert_parallel_world_size(group_name: str = "") -> int:
    """Expert-parallel size of ``group_name`` (1 for a name with no groups, as with no MoE)."""
    mesh = _named_expert_mesh(group_name)
    return 1 if mesh is None else mesh.size("ep")


def _get_expert_parallel_rank(group_name: str = "") -> int:
    """This rank's index in its expert-parallel group (0 for a name with no groups)."""
    mesh = _named_expert_mesh(group_name)
    return 0 if mesh is None else mesh.local_rank("ep")


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """Global rank of the first rank of this rank's expert-parallel group."""
    return _get_expert_parallel_ranks(group_name)[0]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert_mesh(group_name).size("edp")


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert_mesh(group_name).local_rank("edp")


def _get_expert_data_parallel_src_rank(group_name: str) -> int:
    """Global rank of the first rank of this rank's expert-data-parallel group."""
    return _get_expert_data_parallel_ranks(group_name)[0]


def _get_max_expert_size() -> int:
    """The largest expert-parallel size with groups (1 if none)."""
    return max((e for e, _ in current_topology().expert_meshes()), default=1)


def _get_max_expert_size_name() -> str:
    return expert_group_name(_get_max_expert_size())


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _forget_expert_groups() -> None:
    """Forget every expert group (the process group they belong to was destroyed)."""
    set_current_topology(None)


def _get_broadcast_src_rank() -> int:
    """Global rank of data-parallel rank 0 of this rank's group (the broadcast source)."""
    group = _get_data_parallel_group()
    if group is None or group is comm.get_world_group():
        return 0
    return int(comm.get_global_rank(group, 0))


# DeepSpeed's AutoTP interface (the engine acts as its own mpu): the tensor-parallel axis of the
# current topology, which ``tensor_parallel.autotp_size`` builds.
def get_tensor_model_parallel_group() -> Any:
    """This rank's tensor-parallel group (the world group when every rank is in it)."""
    return _axis_group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return current_topology().size("tp")


def get_tensor_model_parallel_rank() -> int:
    return current_topology().local_rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 of this rank's group (where a batch is
    broadcast from so the whole group runs the same one)."""
    return current_topology().ranks("tp")[0]


def get_data_parallel_group() -> Any:
    return _get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


def get_model_parallel_group() -> Any:
    """The tensor-parallel group (DeepSpeed's AutoTP name for it)."""
    return get_tensor_model_parallel_group()


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()
