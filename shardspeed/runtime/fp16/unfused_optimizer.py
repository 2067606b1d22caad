"""Import-path shim: DeepSpeed's ``deepspeed.runtime.fp16.unfused_optimizer`` (see
:mod:`shardspeed.runtime.optimizer_kinds`)."""

from shardspeed.runtime.optimizer_kinds import FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]
