"""DeepSpeed's ``deepspeed.module_inject``: the AutoTP names its users import from there.

Only re-exports: the AutoTP training switch (``set_autotp_mode``) and the partition
specifications live in ``shardspeed.runtime.tensor_parallel``. Names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardspeed.utils.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from shardspeed.runtime.tensor_parallel.legacy import (
        get_auto_tp_mode,
        is_autotp_training_mode,
        set_autotp_mode,
    )
    from shardspeed.runtime.tensor_parallel.presets import AutoTPPresets
    from shardspeed.runtime.tensor_parallel.specs import (
        AutoTPConfig,
        PartitionType,
        TPLayerSpec,
        merge_autotp_configs,
    )

_LEGACY = "shardspeed.runtime.tensor_parallel.legacy"
_SPECS = "shardspeed.runtime.tensor_parallel.specs"
_NAMES = {
    "set_autotp_mode": _LEGACY,
    "is_autotp_training_mode": _LEGACY,
    "get_auto_tp_mode": _LEGACY,
    "TPLayerSpec": _SPECS,
    "AutoTPConfig": _SPECS,
    "PartitionType": _SPECS,
    "merge_autotp_configs": _SPECS,
    "AutoTPPresets": "shardspeed.runtime.tensor_parallel.presets",
}

__all__ = [
    "AutoTPConfig",
    "AutoTPPresets",
    "PartitionType",
    "TPLayerSpec",
    "get_auto_tp_mode",
    "is_autotp_training_mode",
    "merge_autotp_configs",
    "set_autotp_mode",
]

__getattr__ = lazy_exports(__name__, _NAMES)
