"""DeepSpeed's import path for the loss scalers (``deepspeed.runtime.fp16.loss_scaler``)."""

from shardspeed.runtime.precision.loss_scaler import (
    CreateLossScaler,
    DynamicLossScaler,
    LossScaler,
    LossScalerBase,
    StaticLossScaler,
)

__all__ = [
    "CreateLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "LossScalerBase",
    "StaticLossScaler",
]
