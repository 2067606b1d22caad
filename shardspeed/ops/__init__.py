"""shardspeed's optimizers: DeepSpeed's classes, on PyTorch's fused and foreach kernels.

``shardspeed.ops.adam.FusedAdam`` / ``DeepSpeedCPUAdam``, ``shardspeed.ops.lamb.FusedLamb``,
``shardspeed.ops.lion.FusedLion`` / ``DeepSpeedCPULion`` and
``shardspeed.ops.adagrad.DeepSpeedCPUAdagrad`` live at DeepSpeed's dotted paths; no native code
is built; :mod:`.op_builder` and ``__compatible_ops__`` say so under DeepSpeed's names.
:func:`shardspeed.ops.factory.build_optimizer` maps a config's optimizer type to one.
"""

from shardspeed.ops import adagrad, adam, lamb, lion, op_builder
from shardspeed.ops.op_builder.all_ops import op_compatibility

__compatible_ops__: dict[str, bool] = op_compatibility()

__all__ = ["__compatible_ops__", "adagrad", "adam", "lamb", "lion", "op_builder"]
