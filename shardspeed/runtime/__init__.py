"""DeepSpeed's ``deepspeed.runtime`` package: the engine and its parts.

``import deepspeed`` makes ``deepspeed.runtime.engine`` (and the other runtime submodules)
reachable as attributes; here each submodule is imported on its first attribute access (PEP
562), so ``import shardspeed`` stays fast and the attribute path still works. DeepSpeed's
``deepspeed.runtime.DeepSpeedOptimizer`` is the optimizer-wrapper base class.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

#: names DeepSpeed defines in the package itself -> the module that holds them here
_NAMES = {"DeepSpeedOptimizer": "shardspeed.runtime.base_optimizer"}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule, on first use
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
