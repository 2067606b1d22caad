"""``pipeline``: pipeline-parallel engine settings."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.fieldtypes import IntOrAuto

__all__ = ["PipelineConfig"]


class PipelineConfig(DeepSpeedConfigModel):
    """``pipeline``: stages, partitioning and activation transfer of ``PipelineEngine``."""

    json_key: ClassVar[str] = "pipeline"

    stages: IntOrAuto = "auto"
    """Number of pipeline stages, or ``"auto"`` (taken from the ``PipelineModule``)."""
    partition: str = "best"
    """Layer partitioning method."""
    seed_layers: bool = False
    """Seed each layer separately."""
    activation_checkpoint_interval: int = Field(default=0, ge=0)
    """Checkpoint every this many layers (0 disables)."""
    pipe_partitioned: bool = True
    """Partition activations sent between stages across the model-parallel group."""
    grad_partitioned: bool = True
    """Partition gradients sent between stages across the model-parallel group."""
    use_reentrant: bool = True
    """Activation checkpointing with the reentrant function (``checkpointing.checkpoint``);
    False uses ``checkpointing.non_reentrant_checkpoint``, whose stage inputs need no grad."""
