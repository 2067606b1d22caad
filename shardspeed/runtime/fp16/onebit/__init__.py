"""DeepSpeed's 1-bit optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB (ZeRO stage 0)."""

from shardspeed.runtime.fp16.onebit.adam import OnebitAdam
from shardspeed.runtime.fp16.onebit.lamb import OnebitLamb
from shardspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
