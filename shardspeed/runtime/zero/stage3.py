"""Import-path shim: DeepSpeed's ``deepspeed.runtime.zero.stage3``, re-exporting the ZeRO-3
memory estimators. No code lives here; the stage 3 strategy will get its own modules.

ZeRO-3 training itself (partitioned parameters) is not implemented yet: ``zero_optimization.stage
= 3`` is refused at initialize. The estimators need only parameter counts
(:mod:`~shardspeed.runtime.zero.estimators`).
"""

from __future__ import annotations

from shardspeed.runtime.zero.estimators import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from shardspeed.runtime.zero.estimators import zero3_model_to_params as model_to_params

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]
