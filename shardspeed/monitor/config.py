"""DeepSpeed's ``deepspeed.monitor.config`` path: re-exports only."""

from shardspeed.config.monitor import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)

__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig"]
