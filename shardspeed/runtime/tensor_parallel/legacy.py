"""DeepSpeed's legacy AutoTP training calls: ``tp_model_init`` and ``set_autotp_mode``.

Sharding happens in ``initialize``. ``tp_model_init`` only records its arguments (tensor-parallel
size, dtype, optional ``tp_group``), and :func:`merge_tp_settings` reconciles that record with
the config there: the config is canonical, what it leaves out comes from the record, and any
disagreement is an error that names both values.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from shardspeed.utils.logging import logger

__all__ = [
    "AUTOTP_MODE",
    "TPInitRecord",
    "clear_tp_model_init",
    "get_auto_tp_mode",
    "is_autotp_training_mode",
    "merge_tp_settings",
    "recorded_tp_model_init",
    "set_autotp_mode",
    "tp_model_init",
]


class AUTOTP_MODE(Enum):  # noqa: N801 - DeepSpeed's name
    """Whether AutoTP layers are built for training or for inference."""

    TRAINING = 1
    INFERENCE = 2


_mode = AUTOTP_MODE.INFERENCE


def set_autotp_mode(training: bool = False) -> None:
    """Switch AutoTP to training (``True``) or back to inference (the default)."""
    global _mode
    _mode = AUTOTP_MODE.TRAINING if training else AUTOTP_MODE.INFERENCE


def get_auto_tp_mode() -> AUTOTP_MODE:
    """The mode :func:`set_autotp_mode` last set."""
    return _mode


def is_autotp_training_mode() -> bool:
    """Whether :func:`set_autotp_mode` last asked for training."""
    return _mode is AUTOTP_MODE.TRAINING


@dataclass(frozen=True)
class TPInitRecord:
    """Tensor-parallel settings: what ``tp_model_init`` was given, or the merged result."""

    tp_size: int
    dtype: torch.dtype | None
    tp_group: Any = None


_record: TPInitRecord | None = None

MODEL_ATTRIBUTE = "_shardspeed_tp_init"
"""The attribute of the model ``tp_model_init`` stores its :class:`TPInitRecord` under."""


def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype,
    config: dict[str, Any] | str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Record ``tp_size``, ``dtype`` and ``kwargs['tp_group']`` for ``initialize``; return
    ``model`` unchanged (sharding happens in ``initialize``) and switch AutoTP to training.

    The record is kept for the process and on the model. A second call must repeat the first
    call's settings.
    """
    global _record
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"tp_model_init: dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}"
        )
    tp_group = kwargs.pop("tp_group", None)
    if kwargs:
        logger.warning(
            f"tp_model_init ignores {sorted(kwargs)}: only tp_group is read from its keywords"
        )
    if config is not None:
        logger.warning("tp_model_init does not read its config: pass the config to initialize")
    record = TPInitRecord(tp_size=tp_size, dtype=dtype, tp_group=tp_group)
    if _record is not None:
        _check_repeat(_record, record)
    _record = record
    setattr(model, MODEL_ATTRIBUTE, record)
    # DeepSpeed's tp_model_init switches AutoTP to training too; callers may rely on it
    set_autotp_mode(training=True)
    return model


def _check_repeat(first: TPInitRecord, again: TPInitRecord) -> None:
    """A later ``tp_model_init`` call must agree with the first one."""
    if (first.tp_size, first.dtype) != (again.tp_size, again.dtype):
        raise ValueError(
            f"tp_model_init was called with tp_size={again.tp_size}, dtype={again.dtype} after "
            f"tp_size={first.tp_size}, dtype={first.dtype}; use one setting (clear_tp_model_init() "
            "forgets the first)"
        )
    if (first.tp_group is None) != (again.tp_group is None) or (
        first.tp_group is not None and _group_size(first.tp_group) != _group_size(again.tp_group)
    ):
        raise ValueError(
            "tp_model_init was called again with a different tp_group; pass the same group (or "
            "none) every time"
        )


def recorded_tp_model_init() -> TPInitRecord | None:
    """What ``tp_model_init`` recorded in this process, or None."""
    return _record


def clear_tp_model_init() -> None:
    """Forget the recorded ``tp_model_init`` call and return AutoTP to inference mode."""
    global _record
    _record = None
    set_autotp_mode(training=False)


def _group_size(group: Any) -> int:
    """Ranks in ``group``: a CommGroup's ``world_size``, a ProcessGroup's ``size()``, or comm's."""
    size = getattr(group, "world_size", None)
    if isinstance(size, int):
        return size
    if callable(getattr(group, "size", None)):
        return int(group.size())
    from shardspeed import comm

    return comm.get_world_size(group)


def _mpu_tp_size(mpu: Any) -> int | None:
    """The tensor-parallel size an ``mpu`` reports (Megatron's getter names), or None."""
    for getter in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if callable(getattr(mpu, getter, None)):
            return int(getattr(mpu, getter)())
    return None


def merge_tp_settings(
    config_autotp_size: int,
    config_dtype: torch.dtype | None,
    record: TPInitRecord | None,
    mpu: Any,
) -> TPInitRecord | None:
    """The tensor-parallel settings ``initialize`` trains with, or None for no AutoTP training.

    ``config_autotp_size`` is ``tensor_parallel.autotp_size`` (0: not set); ``config_dtype`` the
    dtype the config's ``bf16``/``fp16`` section enables (None when neither is, as DeepSpeed
    reads it: an fp32 config does not conflict); ``record`` what ``tp_model_init``
    recorded; ``mpu`` the one given to ``initialize``. The config wins where it speaks, the
    record fills the rest; a disagreement in size, dtype or group size is a ValueError, as is a
    ``tp_group`` together with an ``mpu`` (two group sources) and ``set_autotp_mode(training=True)``
    with no size at all. Without a ``tp_group`` the caller builds the group (from the ``mpu`` or
    its topology's ``tp`` axis).
    """
    if not isinstance(config_autotp_size, int) or config_autotp_size < 0:
        raise ValueError(
            f"tensor_parallel.autotp_size must be a non-negative integer, got {config_autotp_size!r}"
        )
    if record is None:
        if config_autotp_size == 0:
            if is_autotp_training_mode():
                raise ValueError(
                    "set_autotp_mode(training=True) was called but nothing gives the tensor-parallel "
                    "size: set tensor_parallel.autotp_size in the config or call "
                    "tp_model_init(model, tp_size=..., dtype=...) before initialize"
                )
            return None
        merged = TPInitRecord(tp_size=config_autotp_size, dtype=config_dtype)
    else:
        if record.tp_group is not None and mpu is not None:
            raise ValueError(
                "tp_model_init was given a tp_group and initialize an mpu: both define the "
                "tensor-parallel group; pass only one of them"
            )
        if config_autotp_size not in (0, record.tp_size):
            raise ValueError(
                f"Conflicting tensor_parallel.autotp_size: the config says {config_autotp_size}, "
                f"tp_model_init said tp_size={record.tp_size}; make them equal or drop one"
            )
        if config_dtype is not None and record.dtype is not None and config_dtype != record.dtype:
            raise ValueError(
                f"Conflicting dtype: the config trains in {config_dtype}, tp_model_init said "
                f"{record.dtype}; make them equal (fp16/bf16 in the config, or tp_model_init's dtype)"
            )
        merged = TPInitRecord(
            tp_size=record.tp_size,
            dtype=config_dtype if config_dtype is not None else record.dtype,
            tp_group=record.tp_group,
        )
        if merged.tp_group is not None and _group_size(merged.tp_group) != merged.tp_size:
            raise ValueError(
                f"tp_model_init's tp_group has {_group_size(merged.tp_group)} ranks but the "
                f"tensor-parallel size is {merged.tp_size}; pass a group of {merged.tp_size} ranks"
            )
    mpu_size = None if mpu is None else _mpu_tp_size(mpu)
    if mpu_size is not None and mpu_size != merged.tp_size:
        raise ValueError(
            f"The mpu's tensor-parallel world size is {mpu_size} but the tensor-parallel size is "
            f"{merged.tp_size} (tensor_parallel.autotp_size / tp_model_init); make them equal"
        )
    return merged
