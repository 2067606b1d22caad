"""DeepSpeed's ``deepspeed.module_inject.autotp_config``: AutoTP partition specs (re-exported)."""

from __future__ import annotations

from shardspeed.runtime.tensor_parallel.presets import AutoTPPresets
from shardspeed.runtime.tensor_parallel.specs import (
    AutoTPConfig,
    PartitionType,
    TPLayerSpec,
    merge_autotp_configs,
)

__all__ = ["AutoTPConfig", "AutoTPPresets", "PartitionType", "TPLayerSpec", "merge_autotp_configs"]
