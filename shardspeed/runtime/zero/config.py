"""DeepSpeed's ``deepspeed.runtime.zero.config`` path: re-exports only."""

from shardspeed.config.offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)
from shardspeed.config.zero import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroLeafModuleConfig,
    ZenFlowConfig,
    ZeroStageEnum,
)

__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroLeafModuleConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZenFlowConfig",
    "ZeroStageEnum",
]
