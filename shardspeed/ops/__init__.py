"""shardspeed's optimizers: DeepSpeed's classes, on PyTorch's fused and foreach kernels.

``shardspeed.ops.adam.FusedAdam`` / ``DeepSpeedCPUAdam``, ``shardspeed.ops.lamb.FusedLamb``,
``shardspeed.ops.lion.FusedLion`` / ``DeepSpeedCPULion`` and
``shardspeed.ops.adagrad.DeepSpeedCPUAdagrad`` live at DeepSpeed's dotted paths; no native code
is built. :func:`shardspeed.ops.factory.build_optimizer` maps a config's optimizer type to one.
"""

from shardspeed.ops import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
