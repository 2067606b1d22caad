"""Sequence parallelism (``deepspeed.sequence``): DeepSpeed-Ulysses' ``DistributedAttention``."""

from shardspeed.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention"]
