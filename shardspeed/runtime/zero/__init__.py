"""DeepSpeed's ``deepspeed.runtime.zero`` package: the ZeRO stages.

The names DeepSpeed's package exports (``ZeroParamStatus``, ``Init``, ``GatheredParameters``,
...) and every submodule (``deepspeed.runtime.zero.stage3``) are reachable as attributes; each
is imported on first use (PEP 562), so importing a submodule (the config models) does not pull
in the rest of the ZeRO machinery.
"""

from __future__ import annotations

from shardspeed.utils.lazy_exports import lazy_exports

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
    "unwrap_model_for_generation": "shardspeed.runtime.unwrap_generation",
}

__all__ = sorted(_NAMES)


__getattr__ = lazy_exports(__name__, _NAMES)
