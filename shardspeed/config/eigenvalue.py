"""``eigenvalue``: per-block Hessian eigenvalue estimation (logged to the monitors)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["EigenvalueConfig"]


class EigenvalueConfig(DeepSpeedConfigModel):
    """``eigenvalue``: power-iteration settings and which layers are measured."""

    json_key: ClassVar[str] = "eigenvalue"

    enabled: bool = False
    """Compute eigenvalues at gradient-accumulation boundaries."""
    verbose: bool = False
    """Log every estimate."""
    max_iter: int = Field(default=100, gt=0)
    """Power-iteration steps."""
    tol: float = Field(default=1e-2, gt=0.0)
    """Convergence tolerance."""
    stability: float = Field(default=1e-6, ge=0.0)
    """Added to denominators for numerical stability."""
    gas_boundary_resolution: int = Field(default=1, gt=0)
    """Compute every this many accumulation boundaries."""
    layer_name: str = "bert.encoder.layer"
    """Module path of the layer list."""
    layer_num: int = Field(default=0, ge=0)
    """Number of layers measured."""
