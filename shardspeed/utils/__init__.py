"""Utilities DeepSpeed documents under ``deepspeed.utils``.

The ``safe_*`` ZeRO state accessors and the ZeRO-3 leaf-module marks need torch and are
loaded on first use (PEP 562), so that
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


_LEAF_MODULE_NAMES = frozenset(
    {
        "get_z3_leaf_modules",
        "set_z3_leaf_module",
        "set_z3_leaf_modules",
        "set_z3_leaf_modules_by_name",
        "set_z3_leaf_modules_by_suffix",
        "unset_z3_leaf_modules",
        "z3_leaf_module",
        "z3_leaf_parameter",
    }
)


_SUBMODULES = frozenset({"groups", "numa", "torch"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # DeepSpeed's utils imports these eagerly; here on first use
        submodule = importlib.import_module(f"shardspeed.utils.{name}")
        globals()[name] = submodule
        return submodule
    for names, module in (
        (_TENSOR_FRAGMENT_NAMES, "shardspeed.utils.tensor_fragment"),
        (_LEAF_MODULE_NAMES, "shardspeed.utils.leaf_modules"),
    ):
        if name in names:
            value = getattr(importlib.import_module(module), name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'shardspeed.utils' has no attribute {name!r}")


__all__ = [
    "RepeatingLoader",
    "log_dist",
    "logger",
    *sorted(_TENSOR_FRAGMENT_NAMES),
    *sorted(_LEAF_MODULE_NAMES),
]
