"""Mixed-precision sections: ``fp16``, ``bf16`` (legacy ``bfloat16``), ``torch_autocast``,
``amp`` and ``data_types``."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.fieldtypes import FloatDType

__all__ = [
    "DEFAULT_LOWER_PRECISION_SAFE_MODULES",
    "DataTypesConfig",
    "DeepSpeedAmpConfig",
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "TorchAutocastConfig",
]

DEFAULT_LOWER_PRECISION_SAFE_MODULES: list[str] = [
    "torch.nn.Linear",
    "torch.nn.Conv1d",
    "torch.nn.Conv2d",
    "torch.nn.Conv3d",
]


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """``fp16``: half-precision training with static or dynamic loss scaling."""

    json_key: ClassVar[str] = "fp16"

    enabled: bool = False
    """Enable fp16 mixed-precision training."""
    auto_cast: bool = False
    """Cast the forward inputs to fp16 automatically."""
    loss_scale: float = Field(default=0.0, ge=0.0)
    """Static loss scale; ``0`` selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Overflow-free iterations before the dynamic scale is raised."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is lowered."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every overflow-free iteration."""
    min_loss_scale: int = 1
    """Floor of the dynamic loss scale."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and grads in fp16 (only with DeepSpeedCPUAdam and ZeRO 1-3)."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _finite_number(cls, value: Any) -> Any:
        # bool is an int to pydantic; a loss scale of True is a mistake, not 1.0
        if isinstance(value, bool):
            raise ValueError(f"loss_scale must be a number, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"loss_scale must be finite, got {value!r}")
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_params(self) -> DeepSpeedFP16Config:
        # Only checked when they are used: a static scale may carry unused values.
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError(
                    f"loss_scale_window must be > 0 with dynamic loss scaling, "
                    f"got {self.loss_scale_window}"
                )
            if self.min_loss_scale <= 0:
                raise ValueError(
                    f"min_loss_scale must be > 0 with dynamic loss scaling, got {self.min_loss_scale}"
                )
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts (``loss_scale == 0``)."""
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        """The first dynamic loss scale, ``2**initial_scale_power``."""
        return float(2**self.initial_scale_power)


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """``bf16`` (legacy key ``bfloat16``): bfloat16 training."""

    json_key: ClassVar[str] = "bf16"

    enabled: bool = False
    """Enable bfloat16 mixed-precision training."""
    immediate_grad_update: bool = False
    """Apply gradient updates immediately rather than delayed."""
    check_grad_overflow: bool = False
    """Check gradients for overflow/underflow (0.19.2 default False)."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and grads in bf16 in the ZeRO optimizer (ZeRO 1-3 only)."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 (requires ``bf16_master_weights_and_grads``)."""

    @model_validator(mode="after")
    def _states_need_master(self) -> DeepSpeedBF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError(
                "bf16_optimizer_states requires bf16_master_weights_and_grads to be true"
            )
        return self


class TorchAutocastConfig(DeepSpeedConfigModel):
    """``torch_autocast``: run forward under ``torch.autocast`` instead of casting the model."""

    json_key: ClassVar[str] = "torch_autocast"

    enabled: bool = False
    """Enable ``torch.autocast`` inside ``engine.forward``."""
    dtype: FloatDType | None = None
    """Lower-precision dtype for autocast (``"bfloat16"``, ``"fp16"``, ...); None = bf16."""
    lower_precision_safe_modules: list[str] | None = None
    """Module classes whose grads/params are communicated in ``dtype`` (None = the defaults)."""

    @property
    def resolved_dtype(self) -> torch.dtype:
        """``dtype``, or ``torch.bfloat16`` when not given."""
        return self.dtype if self.dtype is not None else torch.bfloat16

    @property
    def resolved_lower_precision_safe_modules(self) -> list[str]:
        """The configured module list, or :data:`DEFAULT_LOWER_PRECISION_SAFE_MODULES`."""
        if self.lower_precision_safe_modules is None:
            return list(DEFAULT_LOWER_PRECISION_SAFE_MODULES)
        return list(self.lower_precision_safe_modules)


class DeepSpeedAmpConfig(DeepSpeedConfigModel):
    """``amp``: NVIDIA Apex AMP; every key besides ``enabled`` is passed to ``amp.initialize``."""

    model_config = ConfigDict(extra="allow")
    json_key: ClassVar[str] = "amp"

    enabled: bool = False
    """Enable Apex AMP (not available in shardspeed; the engine rejects it)."""

    @property
    def params(self) -> dict[str, Any]:
        """The keyword arguments for ``apex.amp.initialize``."""
        return dict(self.model_extra or {})


class DataTypesConfig(DeepSpeedConfigModel):
    """``data_types``: dtype overrides (None = follow the mixed-precision settings)."""

    json_key: ClassVar[str] = "data_types"

    grad_accum_dtype: FloatDType | None = None
    """Dtype gradients are accumulated in."""
    param_dtype: FloatDType | None = None
    """Dtype the model parameters are cast to."""
    buffer_dtype: FloatDType | None = None
    """Dtype the model buffers are cast to (None keeps their loaded dtype)."""
