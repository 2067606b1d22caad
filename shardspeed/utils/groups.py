"""DeepSpeed's ``deepspeed.utils.groups``: which process group each parallel axis uses.

Hugging Face Transformers and Accelerate ask this module for the data-, model- and
sequence-parallel sizes. A model-parallel unit (``mpu``, Megatron's interface) given to
:func:`initialize` answers for the axes it knows; otherwise every rank is one data-parallel group
and the model- and sequence-parallel axes have size 1 (shardspeed has no sequence parallelism of
its own, so asking for such a group is an error that says so).

Expert parallelism (Mixture of Experts) has its groups made by
:func:`_create_expert_and_data_parallel`, once per ``ep_size``, and named ``ep_size_<n>`` as in
DeepSpeed: each is a :class:`~shardspeed.comm.Topology` with an ``expert`` axis (the ranks that
split one layer's experts between them) and an ``expert_data`` axis (the ranks holding the same
experts, over which their gradients are reduced). The expert-parallel ranks are consecutive by
default; ``use_data_before_expert_parallel_`` puts the data-parallel ranks together instead.
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm

__all__ = ["initialize", "get_mpu"]

_mpu: Any = None
#: ``ep_size_<n>`` -> the expert / expert-data grid of that expert-parallel size
_expert_topologies: dict[str, comm.Topology] = {}
#: the world group the expert groups were made in (a new process group makes them stale)
_expert_world: list[Any] = []


def _drop_stale_expert_groups() -> None:
    world = comm.get_world_group() if comm.is_initialized() else None
    if _expert_world and _expert_world[0] is not world:
        _expert_topologies.clear()
        _expert_world.clear()


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Record the model-parallel unit the groups below defer to (``None``: none) and make the
    expert-parallel groups of ``ep_size`` (> 1; those of 1 are made by the first MoE layer)."""
    global _mpu
    _mpu = mpu
    if ep_size > 1:
        _create_expert_and_data_parallel(ep_size)


def get_mpu() -> Any:
    """The model-parallel unit given to :func:`initialize`, or ``None``."""
    return _mpu


def _ask_mpu(method: str) -> tuple[bool, Any]:
    if _mpu is not None and hasattr(_mpu, method):
        return True, getattr(_mpu, method)()
    return False, None


def _get_data_parallel_group() -> Any:
    """The data-parallel group: the mpu's, else the world group."""
    found, group = _ask_mpu("get_data_parallel_group")
    return group if found else comm.get_world_group()


def _get_data_parallel_world_size() -> int:
    found, size = _ask_mpu("get_data_parallel_world_size")
    return int(size) if found else comm.get_world_size(_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    found, rank = _ask_mpu("get_data_parallel_rank")
    return int(rank) if found else comm.get_rank(_get_data_parallel_group())


def _get_model_parallel_group() -> Any:
    """The mpu's model-parallel group; without an mpu there is none (an error says so)."""
    found, group = _ask_mpu("get_model_parallel_group")
    if not found:
        raise RuntimeError(
            "no model-parallel group: no mpu was given (deepspeed.initialize(mpu=...) or "
            "groups.initialize(mpu=...)), so the model-parallel size is 1"
        )
    return group


def _get_model_parallel_world_size() -> int:
    found, size = _ask_mpu("get_model_parallel_world_size")
    return int(size) if found else 1


def _get_model_parallel_rank() -> int:
    found, rank = _ask_mpu("get_model_parallel_rank")
    return int(rank) if found else 0


def _get_sequence_parallel_group() -> Any:
    """The mpu's sequence-parallel group; shardspeed has none of its own (an error says so)."""
    found, group = _ask_mpu("get_sequence_parallel_group")
    if not found:
        raise RuntimeError(
            "no sequence-parallel group: shardspeed has no sequence parallelism of its own and "
            "no mpu providing get_sequence_parallel_group was given; the sequence-parallel size "
            "is 1"
        )
    return group


def _get_sequence_parallel_world_size() -> int:
    found, size = _ask_mpu("get_sequence_parallel_world_size")
    return int(size) if found else 1


def _get_sequence_parallel_rank() -> int:
    found, rank = _ask_mpu("get_sequence_parallel_rank")
    return int(rank) if found else 0


def _get_sequence_data_parallel_group() -> Any:
    """Sequence and data parallel together: the mpu's, else the data-parallel group."""
    found, group = _ask_mpu("get_sequence_data_parallel_group")
    return group if found else _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    found, size = _ask_mpu("get_sequence_data_parallel_world_size")
    return int(size) if found else _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    found, rank = _ask_mpu("get_sequence_data_parallel_rank")
    return int(rank) if found else _get_data_parallel_rank()


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of ``ep_size``."""
    return f"ep_size_{ep_size}"


def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    """Make the expert-parallel and expert-data-parallel groups of ``expert_parallel_size_``
    (every rank calls it; a second call with the same size does nothing).

    With world size W and ep_size E: W/E expert-parallel groups of E ranks each split every MoE
    layer's experts, and E expert-data-parallel groups of W/E ranks each hold the same experts.
    Default order: expert-parallel ranks consecutive (``[0, 1]``, ``[2, 3]`` for W=4, E=2);
    ``use_data_before_expert_parallel_``: expert-data-parallel ranks consecutive instead.
    """
    ep_size = int(expert_parallel_size_)
    name = expert_group_name(ep_size)
    _drop_stale_expert_groups()
    if name in _expert_topologies:
        return
    world = comm.get_world_size()
    if _get_model_parallel_world_size() > 1 or _get_sequence_parallel_world_size() > 1:
        raise NotImplementedError(
            "expert parallelism together with model or sequence parallelism (an mpu with more "
            "than one rank on those axes) is not supported by shardspeed; use data and expert "
            "parallelism only"
        )
    if ep_size < 1 or world % ep_size != 0:
        raise ValueError(
            f"ep_size={ep_size} must divide the data-parallel world size ({world}); choose an "
            f"ep_size among {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    axes = {"expert_data": world // ep_size, "expert": ep_size}
    if use_data_before_expert_parallel_:
        axes = {"expert": ep_size, "expert_data": world // ep_size}
    _expert_topologies[name] = comm.Topology(axes=axes)
    if not _expert_world:
        _expert_world.append(comm.get_world_group())


def _expert_topology(group_name: str) -> comm.Topology:
    _drop_stale_expert_groups()
    try:
        return _expert_topologies[group_name]
    except KeyError:
        made = sorted(_expert_topologies) or "none"
        raise RuntimeError(
            f"no expert-parallel groups named {group_name!r} (made so far: {made}); they are "
            "made by deepspeed.initialize for the MoE layers of the model, or by "
            "groups._create_expert_and_data_parallel(ep_size)"
        ) from None


def _group_or_world(topology: comm.Topology, axis: str) -> Any:
    group = topology.get_group(axis)
    return comm.get_world_group() if group is None else group


def _get_expert_parallel_group(group_name: str) -> Any:
    """The process group splitting the experts of the layers named ``group_name``."""
    return _group_or_world(_expert_topology(group_name), "expert")


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: _group_or_world(t, "expert") for name, t in _expert_topologies.items()}


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """The process group over which the experts of ``group_name`` reduce their gradients."""
    return _group_or_world(_expert_topology(group_name), "expert_data")


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: _group_or_world(t, "expert_data") for name, t in _expert_topologies.items()}


def _get_expert_parallel_ranks(group_name: str) -> list[int]:
    """Global ranks of this rank's expert-parallel group."""
    return _expert_topology(group_name).get_ranks("expert")


def _get_expert_data_parallel_ranks(group_name: str) -> list[int]:
    """Global ranks of this rank's expert-data-parallel group."""
    return _expert_topology(group_name).get_ranks("expert_data")


def _get_expert_parallel_world_size(group_name: str = "") -> int:
    """Expert-parallel size of ``group_name`` (1 for a name with no groups, as with no MoE)."""
    _drop_stale_expert_groups()
    if group_name not in _expert_topologies:
        return 1
    return _expert_topologies[group_name].get_world_size("expert")


def _get_expert_parallel_rank(group_name: str = "") -> int:
    """This rank's index in its expert-parallel group (0 for a name with no groups)."""
    _drop_stale_expert_groups()
    if group_name not in _expert_topologies:
        return 0
    return _expert_topologies[group_name].get_rank("expert")


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """Global rank of the first rank of this rank's expert-parallel group."""
    return _get_expert_parallel_ranks(group_name)[0]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert_topology(group_name).get_world_size("expert_data")


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert_topology(group_name).get_rank("expert_data")


def _get_expert_data_parallel_src_rank(group_name: str) -> int:
    """Global rank of the first rank of this rank's expert-data-parallel group."""
    return _get_expert_data_parallel_ranks(group_name)[0]


def _get_max_expert_size() -> int:
    """The largest expert-parallel size with groups (1 if none)."""
    sizes = [t.get_world_size("expert") for t in _expert_topologies.values()]
    return max(sizes, default=1)


def _get_max_expert_size_name() -> str:
    return expert_group_name(_get_max_expert_size())


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _forget_expert_groups() -> None:
    """Forget every expert group (the process group they belong to was destroyed)."""
    _expert_topologies.clear()
    _expert_world.clear()


def _get_broadcast_src_rank() -> int:
    """Global rank of data-parallel rank 0 of this rank's group (the broadcast source)."""
    group = _get_data_parallel_group()
    if group is None or group is comm.get_world_group():
        return 0
    return int(comm.get_global_rank(group, 0))
