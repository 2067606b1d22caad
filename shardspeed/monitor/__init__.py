"""DeepSpeed's ``deepspeed.monitor``: TensorBoard, W&B, Comet and CSV event writers."""

from shardspeed.monitor.monitor import Monitor, MonitorMaster

__all__ = ["Monitor", "MonitorMaster"]
