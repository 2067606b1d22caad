"""``deepspeed.zero``: the ZeRO-3 API users call by this short path."""

from __future__ import annotations

from shardspeed.runtime.zero.init_context import Init
from shardspeed.runtime.zero.mics_init import MiCS_Init
from shardspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from shardspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
