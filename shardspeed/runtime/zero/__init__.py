"""DeepSpeed's ``deepspeed.runtime.zero`` package: the ZeRO stages.

The names DeepSpeed's package exports (``ZeroParamStatus``, ``Init``, ``GatheredParameters``,
...) and every submodule (``deepspeed.runtime.zero.stage3``) are reachable as attributes; each
is imported on first use (PEP 562), so importing a submodule (the config models) does not pull
in the rest of the ZeRO machinery.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

#: DeepSpeed's exported name -> the module that holds it here
_NAMES = {
    "ZeroParamType": "shardspeed.runtime.zero.zero_parameter",
    "ZeroParamStatus": "shardspeed.runtime.zero.zero_parameter",
    "Init": "shardspeed.runtime.zero.init_context",
    "GatheredParameters": "shardspeed.runtime.zero.partition_parameters",
    "register_external_parameter": "shardspeed.runtime.zero.partition_parameters",
    "TiledLinear": "shardspeed.runtime.zero.tiling",
    "TiledLinearReturnBias": "shardspeed.runtime.zero.tiling",
    "MiCS_Init": "shardspeed.runtime.zero.mics_init",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule, on first use
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})
