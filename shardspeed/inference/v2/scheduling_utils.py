"""Results of the engine's schedulability check (DeepSpeed's ``scheduling_utils``)."""

from __future__ import annotations

from enum import Enum

__all__ = ["SchedulingError", "SchedulingResult"]


class SchedulingResult(Enum):
    """Whether a proposed ragged batch can run, and if not which limit it breaks."""

    Success = 0
    EngineSequenceLimitExceeded = 1
    """More sequences would be tracked than ``max_tracked_sequences``."""
    BatchSequenceLimitExceeded = 2
    """More sequences in the batch than ``max_ragged_sequence_count``."""
    BatchTokenLimitExceeded = 3
    """More tokens in the batch than ``max_ragged_batch_size``."""
    KVCacheLimitExceeded = 4
    """Not enough free KV blocks."""
    SequenceTokenLimitExceeded = 5
    """A sequence would hold more than ``max_context`` tokens."""


class SchedulingError(ValueError, RuntimeError):
    """A batch failed the schedulability check (a ``RuntimeError`` as DeepSpeed's, and a
    ``ValueError`` as every shardspeed user error); ``result`` says which limit."""

    def __init__(self, result: SchedulingResult, detail: str = "") -> None:
        self.result = result
        super().__init__(f"batch scheduling failed with result {result.name}" + detail)
