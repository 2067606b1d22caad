"""``timers``: the throughput timer."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["ThroughputTimerConfig", "TimersConfig"]


class ThroughputTimerConfig(DeepSpeedConfigModel):
    """``timers.throughput``."""

    json_key: ClassVar[str] = "timers.throughput"

    enabled: bool = True
    """Measure samples per second."""
    synchronized: bool = True
    """Synchronize the device when timing (accurate, slower)."""


class TimersConfig(DeepSpeedConfigModel):
    """``timers``."""

    json_key: ClassVar[str] = "timers"

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """Throughput timer settings."""
