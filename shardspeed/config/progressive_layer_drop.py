"""``progressive_layer_drop``: stochastic layer dropping with a growing keep probability."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["ProgressiveLayerDropConfig"]


class ProgressiveLayerDropConfig(DeepSpeedConfigModel):
    """``progressive_layer_drop``: ``theta`` and ``gamma`` of the keep-probability schedule."""

    json_key: ClassVar[str] = "progressive_layer_drop"

    enabled: bool = False
    """Enable progressive layer drop."""
    theta: float = Field(default=1.0, ge=0.0, le=1.0)
    """Final keep probability."""
    gamma: float = Field(default=0.001, ge=0.0)
    """Rate at which the keep probability decays towards ``theta``."""
