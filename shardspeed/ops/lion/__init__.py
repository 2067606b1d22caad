"""Lion optimizers: :class:`FusedLion` and :class:`DeepSpeedCPULion`."""

from shardspeed.ops.lion.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
