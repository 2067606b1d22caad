"""Utilities DeepSpeed documents under ``deepspeed.utils``.

The ``safe_*`` ZeRO state accessors need torch and are loaded on first use (PEP 562), so that
``import shardspeed`` (which imports ``shardspeed.utils.logging``) stays torch-free.
"""

import importlib
from typing import Any

from shardspeed.utils.loaders import RepeatingLoader
from shardspeed.utils.logging import log_dist, logger

_TENSOR_FRAGMENT_NAMES = frozenset(
    {
        "safe_get_full_fp32_param",
        "safe_get_full_grad",
        "safe_get_full_optimizer_state",
        "safe_get_local_fp32_param",
        "safe_get_local_grad",
        "safe_get_local_optimizer_state",
        "safe_set_full_fp32_param",
        "safe_set_full_grad",
        "safe_set_full_optimizer_state",
        "safe_set_local_fp32_param",
        "safe_set_local_grad",
        "safe_set_local_optimizer_state",
        "safe_update_full_grad_vectorized",
    }
)


def __getattr__(name: str) -> Any:
    if name in _TENSOR_FRAGMENT_NAMES:
        value = getattr(importlib.import_module("shardspeed.utils.tensor_fragment"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardspeed.utils' has no attribute {name!r}")


__all__ = ["RepeatingLoader", "log_dist", "logger", *sorted(_TENSOR_FRAGMENT_NAMES)]
