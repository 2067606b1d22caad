"""DeepSpeed's ``deepspeed.utils.groups``: which process group each parallel axis uses.

Hugging Face Transformers and Accelerate ask this module for the data-, model- and
sequence-parallel sizes. A model-parallel unit (``mpu``, Megatron's interface) given to
:func:`initialize` answers for the axes it knows; otherwise every rank is one data-parallel group
and the model- and sequence-parallel axes have size 1 (shardspeed has no sequence or expert
parallelism yet, so asking for such a group is an error that says so).
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm

__all__ = ["initialize", "get_mpu"]

_mpu: Any = None


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Record the model-parallel unit the groups below defer to (``None``: none).

    ``ep_size`` > 1 (expert parallelism) is not supported yet and raises ``NotImplementedError``.
    """
    global _mpu
    if ep_size != 1:
        raise NotImplementedError(
            f"expert parallelism (ep_size={ep_size}) is not implemented in shardspeed yet; "
            "use ep_size=1"
        )
    _mpu = mpu


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


def _get_expert_parallel_world_size(group_name: str = "") -> int:
    """Expert-parallel size: 1 (shardspeed has no expert parallelism yet)."""
    return 1


def _get_expert_parallel_rank(group_name: str = "") -> int:
    """Expert-parallel rank: 0 (shardspeed has no expert parallelism yet)."""
    return 0


def _get_broadcast_src_rank() -> int:
    """Global rank of data-parallel rank 0 of this rank's group (the broadcast source)."""
    group = _get_data_parallel_group()
    if group is None or group is comm.get_world_group():
        return 0
    return int(comm.get_global_rank(group, 0))
