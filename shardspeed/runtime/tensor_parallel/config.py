"""DeepSpeed's ``deepspeed.runtime.tensor_parallel.config``: the ``tensor_parallel`` section."""

from __future__ import annotations

from shardspeed.config.tensor_parallel import TPConfig, TPTrainingConfig

__all__ = ["TPConfig", "TPTrainingConfig"]
