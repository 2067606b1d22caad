"""DeepSpeed's ``deepspeed.runtime.config_utils`` path: re-exports only."""

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["DeepSpeedConfigModel"]
