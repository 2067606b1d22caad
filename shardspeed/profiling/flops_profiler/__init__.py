"""DeepSpeed's ``deepspeed.profiling.flops_profiler``: FLOPs, MACs, params and latency per module."""

from shardspeed.profiling.flops_profiler.profiler import FlopsProfiler, get_model_profile
from shardspeed.profiling.flops_profiler.report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
