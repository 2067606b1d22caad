"""``optimizer`` and ``scheduler`` sections: a type name plus free-form constructor params."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from shardspeed.config.auto import reject_auto
from shardspeed.config.base import DeepSpeedConfigModel

__all__ = [
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "OptimizerConfig",
    "SchedulerConfig",
]

# Optimizer types DeepSpeed builds itself, matched case-insensitively; any other name is looked
# up in torch.optim by the engine.
DEEPSPEED_OPTIMIZERS: tuple[str, ...] = (
    "adagrad",
    "adam",
    "adamw",
    "lamb",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "muadam",
    "muadamw",
    "musgd",
    "lion",
    "muon",
)

# Schedulers in shardspeed.runtime.lr_schedules; other names are looked up in
# torch.optim.lr_scheduler by the engine.
DEEPSPEED_SCHEDULERS: tuple[str, ...] = (
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
)


def _checked_params(params: dict[str, Any]) -> dict[str, Any]:
    reject_auto(params)
    return params


class OptimizerConfig(DeepSpeedConfigModel):
    """``optimizer``: ``{"type": "AdamW", "params": {"lr": ..., ...}}``."""

    json_key: ClassVar[str] = "optimizer"

    type: str | None = None
    """Optimizer name (DeepSpeed names case-insensitively, else a ``torch.optim`` class)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer constructor; ``"auto"`` is not allowed."""
    legacy_fusion: bool = False
    """Legacy fused-optimizer switch (accepted for compatibility)."""

    @field_validator("params")
    @classmethod
    def _no_auto_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return _checked_params(params)

    @property
    def name(self) -> str | None:
        """``type`` lower-cased when it is a DeepSpeed optimizer, else as given."""
        if self.type is not None and self.type.lower() in DEEPSPEED_OPTIMIZERS:
            return self.type.lower()
        return self.type


class SchedulerConfig(DeepSpeedConfigModel):
    """``scheduler``: ``{"type": "WarmupLR", "params": {"warmup_num_steps": ..., ...}}``."""

    json_key: ClassVar[str] = "scheduler"

    type: str | None = None
    """Scheduler name from :data:`DEEPSPEED_SCHEDULERS` or ``torch.optim.lr_scheduler``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler constructor; ``"auto"`` is not allowed."""

    @field_validator("params")
    @classmethod
    def _no_auto_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return _checked_params(params)
