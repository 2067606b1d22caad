"""Import-path shim: DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2``, re-exporting the
stage 1/2 strategies (:mod:`~shardspeed.runtime.zero.partitioned`), DeepSpeed's optimizer class
name (``isinstance(engine.optimizer, DeepSpeedZeroOptimizer)`` is true at stages 1-2, see
:mod:`~shardspeed.runtime.optimizer_kinds`) and the ZeRO-2 memory estimators
(:mod:`~shardspeed.runtime.zero.estimators`). No code lives here."""

from __future__ import annotations

from shardspeed.runtime.optimizer_kinds import DeepSpeedZeroOptimizer
from shardspeed.runtime.zero.estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_to_params,
)
from shardspeed.runtime.zero.partitioned import (
    GradientPartitionStrategy,
    OptimizerStateStrategy,
    PartitionedStrategy,
)

__all__ = [
    "DeepSpeedZeroOptimizer",
    "GradientPartitionStrategy",
    "OptimizerStateStrategy",
    "PartitionedStrategy",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]
