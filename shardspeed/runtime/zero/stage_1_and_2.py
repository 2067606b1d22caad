"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` path: the stage 1/2 optimizer classes
and the ZeRO-2 memory estimators (:mod:`~shardspeed.runtime.zero.estimators`)."""

from __future__ import annotations

from shardspeed.runtime.zero.estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_to_params,
)
from shardspeed.runtime.zero.partitioned import PartitionedStrategy
from shardspeed.runtime.zero.stage1 import OptimizerStateStrategy
from shardspeed.runtime.zero.stage2 import GradientPartitionStrategy

#: DeepSpeed's class name for the stage 1/2 optimizer; here the shared strategy base
DeepSpeedZeroOptimizer = PartitionedStrategy

__all__ = [
    "DeepSpeedZeroOptimizer",
    "GradientPartitionStrategy",
    "OptimizerStateStrategy",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]
