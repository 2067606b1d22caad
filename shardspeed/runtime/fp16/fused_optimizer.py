"""Import-path shim: DeepSpeed's ``deepspeed.runtime.fp16.fused_optimizer`` (see
:mod:`shardspeed.runtime.optimizer_kinds`)."""

from shardspeed.runtime.optimizer_kinds import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
