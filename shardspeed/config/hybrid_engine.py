"""``hybrid_engine``: switch an actor model between training and generation (RLHF)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["HybridEngineConfig"]


class HybridEngineConfig(DeepSpeedConfigModel):
    """``hybrid_engine``: generation settings of ``DeepSpeedHybridEngine``."""

    json_key: ClassVar[str] = "hybrid_engine"

    enabled: bool = False
    """Use the hybrid engine."""
    max_out_tokens: int = Field(default=512, gt=0)
    """Maximum generated tokens."""
    inference_tp_size: int = Field(default=1, gt=0)
    """Tensor-parallel degree while generating."""
    release_inference_cache: bool = False
    """Free the inference cache after generation."""
    pin_parameters: bool = True
    """Pin the gathered parameters."""
    tp_gather_partition_size: int = Field(default=8, gt=0)
    """Layers gathered at a time for tensor parallelism."""
    enable_cuda_graph: bool = False
    """Capture generation in a CUDA graph."""
