"""Utilities DeepSpeed documents under ``deepspeed.utils``."""

from shardspeed.utils.loaders import RepeatingLoader
from shardspeed.utils.logging import log_dist, logger

__all__ = ["RepeatingLoader", "log_dist", "logger"]
