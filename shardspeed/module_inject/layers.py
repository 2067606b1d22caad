"""DeepSpeed's ``deepspeed.module_inject.layers``: the AutoTP mode switch (re-exported)."""

from __future__ import annotations

from shardspeed.runtime.tensor_parallel.legacy import (
    get_auto_tp_mode,
    is_autotp_training_mode,
    set_autotp_mode,
)

__all__ = ["get_auto_tp_mode", "is_autotp_training_mode", "set_autotp_mode"]
