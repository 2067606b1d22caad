"""Layer 2 of inference v2: the request scheduler (continuous batching, Dynamic SplitFuse,
preemption), per-request sampling and the background-thread engine the server uses."""

from shardspeed.inference.v2.scheduler.async_engine import (
    AsyncGenerationEngine,
    EngineLoopError,
    RequestHandle,
)
from shardspeed.inference.v2.scheduler.requests import ScheduledChunk, TokenEvent
from shardspeed.inference.v2.scheduler.sampling import SamplingParams, sample
from shardspeed.inference.v2.scheduler.scheduler import RaggedScheduler

__all__ = [
    "AsyncGenerationEngine",
    "EngineLoopError",
    "RequestHandle",
    "RaggedScheduler",
    "SamplingParams",
    "ScheduledChunk",
    "TokenEvent",
    "sample",
]
