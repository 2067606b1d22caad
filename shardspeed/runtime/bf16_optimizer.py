"""Import-path shim: DeepSpeed's ``deepspeed.runtime.bf16_optimizer`` (see
:mod:`shardspeed.runtime.optimizer_kinds`)."""

from shardspeed.runtime.optimizer_kinds import BF16_Optimizer

__all__ = ["BF16_Optimizer"]
