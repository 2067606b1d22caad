"""Precision mechanisms: the dtype policy, loss scalers, overflow checks and master weights."""

from shardspeed.runtime.precision.dtypes import parse_dtype
from shardspeed.runtime.precision.loss_scaler import (
    DynamicLossScaler,
    LossScalerBase,
    StaticLossScaler,
    grad_scaler_like,
    loss_scaler_for_policy,
    loss_scaler_from_config,
)
from shardspeed.runtime.precision.master_weights import MasterWeights
from shardspeed.runtime.precision.overflow import has_inf_or_nan, unscale_
from shardspeed.runtime.precision.policy import PrecisionPolicy

__all__ = [
    "DynamicLossScaler",
    "LossScalerBase",
    "MasterWeights",
    "PrecisionPolicy",
    "StaticLossScaler",
    "grad_scaler_like",
    "has_inf_or_nan",
    "loss_scaler_for_policy",
    "loss_scaler_from_config",
    "parse_dtype",
    "unscale_",
]
