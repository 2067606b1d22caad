"""``comms_logger``: logging of collective operations done through ``shardspeed.comm``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["DeepSpeedCommsConfig"]


class DeepSpeedCommsConfig(DeepSpeedConfigModel):
    """``comms_logger``: which collectives are timed and counted, and how verbosely."""

    json_key: ClassVar[str] = "comms_logger"

    enabled: bool = False
    """Record every collective's size and latency."""
    verbose: bool = False
    """Log each operation as it happens."""
    prof_all: bool = True
    """Profile all operations (otherwise only ``prof_ops``)."""
    debug: bool = False
    """Add the calling function's name to each record."""
    prof_ops: list[str] = Field(default_factory=list)
    """Operation names to profile when ``prof_all`` is false."""
