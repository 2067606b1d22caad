"""``activation_checkpointing``: how checkpointed activations are stored and recomputed."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["DeepSpeedActivationCheckpointingConfig"]


class DeepSpeedActivationCheckpointingConfig(DeepSpeedConfigModel):
    """``activation_checkpointing``: partitioning, CPU offload and layout of checkpoints."""

    json_key: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = False
    """Partition checkpointed activations across model-parallel ranks."""
    contiguous_memory_optimization: bool = False
    """Copy checkpoints into one contiguous buffer to avoid fragmentation."""
    cpu_checkpointing: bool = False
    """Keep partitioned checkpoints in CPU memory."""
    number_checkpoints: int | None = Field(default=None, gt=0)
    """Checkpoints per forward, for the contiguous buffer."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at each checkpoint boundary."""
    profile: bool = False
    """Time the checkpointing forward and recompute."""
