"""DeepSpeed's ``deepspeed.runtime.config`` path: re-exports only (the code is in ``shardspeed.config``)."""

from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError, ZeroStageEnum
from shardspeed.config.optimizer import DEEPSPEED_OPTIMIZERS

__all__ = ["DEEPSPEED_OPTIMIZERS", "DeepSpeedConfig", "DeepSpeedConfigError", "ZeroStageEnum"]
