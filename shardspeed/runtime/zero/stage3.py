"""Import-path shim: DeepSpeed's ``deepspeed.runtime.zero.stage3``, re-exporting the stage 3
strategy (:mod:`~shardspeed.runtime.zero.sharded`), DeepSpeed's optimizer class name
(``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)`` is true at stage 3, see
:mod:`~shardspeed.runtime.optimizer_kinds`) and the ZeRO-3 memory estimators
(:mod:`~shardspeed.runtime.zero.estimators`). No code lives here."""

from __future__ import annotations

from shardspeed.runtime.optimizer_kinds import DeepSpeedZeroOptimizer_Stage3
from shardspeed.runtime.zero.estimators import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from shardspeed.runtime.zero.estimators import zero3_model_to_params as model_to_params
from shardspeed.runtime.zero.sharded import ParamPartitionStrategy

__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "ParamPartitionStrategy",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]
