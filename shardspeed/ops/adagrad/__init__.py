"""Adagrad optimizer: :class:`DeepSpeedCPUAdagrad`."""

from shardspeed.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
