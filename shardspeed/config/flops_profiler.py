"""``flops_profiler``: per-module latency, FLOPs and parameters of one training step."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["DeepSpeedFlopsProfilerConfig"]


class DeepSpeedFlopsProfilerConfig(DeepSpeedConfigModel):
    """``flops_profiler``: profile the forward pass at ``profile_step`` and print the report."""

    json_key: ClassVar[str] = "flops_profiler"

    enabled: bool = False
    """Profile once at ``profile_step`` (also turns on the wall-clock breakdown)."""
    recompute_fwd_factor: float = Field(default=0.0, ge=0.0)
    """Extra forward recomputation in backward (activation checkpointing: 1.0)."""
    profile_step: int = Field(default=1, ge=1)
    """Global step at which to profile."""
    module_depth: int = -1
    """Depth of the printed module tree (-1 = all)."""
    top_modules: int = Field(default=1, ge=1)
    """Top modules listed in the aggregated profile."""
    detailed: bool = True
    """Print the per-module profile."""
    output_file: str | None = None
    """Write the report here instead of stdout."""
