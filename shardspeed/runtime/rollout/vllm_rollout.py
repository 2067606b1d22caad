"""DeepSpeed's ``VLLMRollout`` (rollouts from an external vLLM server): not built in shardspeed."""

from __future__ import annotations

from typing import Any

from shardspeed.runtime.rollout.base import (
    RolloutBatch,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
)

__all__ = ["VLLMRollout"]


class VLLMRollout(RolloutEngine):
    """Not built: constructing it raises NotImplementedError naming the alternative."""

    name = "vllm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        raise NotImplementedError(
            "VLLMRollout (generation on an external vLLM server with weight sync) is not built "
            "in shardspeed; use HybridEngineRollout(engine, tokenizer) with "
            '"hybrid_engine": {"enabled": true} in the config'
        )

    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        raise NotImplementedError  # unreachable: construction is refused

    def sync_weights_from_student(self, step: int) -> None:
        raise NotImplementedError  # unreachable: construction is refused
