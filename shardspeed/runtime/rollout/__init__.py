"""DeepSpeed's ``deepspeed.runtime.rollout``: on-policy generation for RL and distillation
trainers, behind one small interface (:class:`RolloutEngine`: a :class:`RolloutRequest` of
left-padded prompts in, a :class:`RolloutBatch` of prompt plus response out).

:class:`HybridEngineRollout` generates with the trained model itself, through
:class:`~shardspeed.runtime.hybrid_engine.DeepSpeedHybridEngine`'s ``generate`` (the ZeRO-3
parameters gathered once per call). :class:`VLLMRollout` (an external vLLM server) is not built.
"""

from shardspeed.runtime.rollout.base import (
    RolloutBatch,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
)
from shardspeed.runtime.rollout.hybrid_engine_rollout import (
    HybridEngineRollout,
    HybridEngineRolloutConfig,
)
from shardspeed.runtime.rollout.vllm_rollout import VLLMRollout

__all__ = [
    "HybridEngineRollout",
    "HybridEngineRolloutConfig",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "VLLMRollout",
]
