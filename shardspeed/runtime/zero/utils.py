"""DeepSpeed's ``deepspeed.runtime.zero.utils``: small questions about ZeRO parameters."""

from __future__ import annotations

import torch

from shardspeed.runtime.zero.records import record_of

__all__ = ["ZeRORuntimeException", "is_zero_param"]


class ZeRORuntimeException(Exception):
    """A ZeRO optimizer was used in a way it does not support (DeepSpeed's class)."""


def is_zero_param(parameter: object) -> bool:
    """Whether ``parameter`` is partitioned by ZeRO-3 (built under ``zero.Init`` or trained at
    stage 3), i.e. it has the ``ds_*`` views."""
    if not isinstance(parameter, torch.Tensor):
        return False
    record = record_of(parameter)
    return record is not None and record.unit is not None
