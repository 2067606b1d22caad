"""``deepspeed.zero``: the ZeRO-3 API users call by this short path."""

from __future__ import annotations

from shardspeed.runtime.zero.init_context import Init
from shardspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
