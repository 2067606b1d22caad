"""``shardspeed.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): activation
checkpointing with partitioning, CPU checkpointing and model-parallel RNG tracking.

Re-exports only; the implementation and its public names (``__all__``) are in
:mod:`shardspeed.runtime.activation_checkpointing.checkpointing`.
"""

from shardspeed.runtime.activation_checkpointing import checkpointing as _implementation
from shardspeed.runtime.activation_checkpointing.checkpointing import *  # noqa: F403 - a facade

__all__ = list(_implementation.__all__)
