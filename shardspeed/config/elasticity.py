"""``elasticity``: batch sizes that stay valid across a range of GPU counts."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["ElasticityConfig"]


class ElasticityConfig(DeepSpeedConfigModel):
    """``elasticity``: the search space for an elastic global batch size."""

    json_key: ClassVar[str] = "elasticity"

    enabled: bool = False
    """Compute the batch sizes from this section instead of the top-level keys."""
    max_train_batch_size: int = Field(default=2000, gt=0)
    """Largest acceptable global batch size."""
    micro_batch_sizes: list[int] = Field(default_factory=lambda: [2, 4, 6])
    """Acceptable micro-batch sizes."""
    min_gpus: int = Field(default=1, gt=0)
    """Smallest GPU count to support."""
    max_gpus: int = Field(default=10000, gt=0)
    """Largest GPU count to support."""
    num_gpus_per_node: int = Field(default=1, gt=0)
    """GPUs per node."""
    model_parallel_size: int = Field(default=1, gt=0)
    """Model-parallel degree."""
    min_time: int = Field(default=0, ge=0)
    """Minimum running time (minutes) before scaling."""
    prefer_larger_batch: bool = True
    """Prefer the larger of equally good batch sizes."""
    ignore_non_elastic_batch_info: bool = False
    """Ignore (instead of rejecting) top-level batch keys when elastic."""
    version: float = 0.2
    """Elasticity algorithm version."""
