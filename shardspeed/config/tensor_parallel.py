"""``tensor_parallel``: automatic tensor-parallel (AutoTP) training."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.fieldtypes import FloatDType

__all__ = ["TPConfig", "TPTrainingConfig"]


class TPConfig(DeepSpeedConfigModel):
    """``tensor_parallel.tensor_parallel`` (alias ``tp``): the TP group."""

    json_key: ClassVar[str] = "tensor_parallel.tensor_parallel"

    tp_size: int = Field(default=1, gt=0)
    """Tensor-parallel degree."""
    tp_grain_size: int = Field(default=1, gt=0)
    """Shard sizes are multiples of this."""
    mpu: Any = Field(default=None, exclude=True)
    """A model-parallel unit supplying the TP group (set from code, not JSON)."""
    tp_group: Any = Field(default=None, exclude=True)
    """An explicit TP process group (set from code, not JSON)."""


class TPTrainingConfig(DeepSpeedConfigModel):
    """``tensor_parallel``: AutoTP degree, presets and custom partition specs."""

    json_key: ClassVar[str] = "tensor_parallel"

    dtype: FloatDType = torch.float16
    """Dtype of the sharded model."""
    autotp_size: int = Field(default=0, ge=0)
    """TP degree; > 0 enables AutoTP training."""
    tp_overlap_comm: bool = False
    """Overlap TP communication with compute."""
    tensor_parallel: TPConfig = Field(default_factory=TPConfig, alias="tp")
    """The TP group settings."""
    injection_policy_tuple: Any = Field(default=None, exclude=True)
    """Injection policy (set from code)."""
    partition_config: dict[str, Any] | None = None
    """Custom partition specs (``use_default_specs``, ``layer_specs``, ...); parsed by AutoTP."""
    preset_model: str | None = None
    """Preset name: llama, bloom, chatglm, mixtral, deepseek_v2, qwen2, phi3."""
    keep_module_on_host: bool = False
    """Keep the unsharded module on the host."""
    replace_with_kernel_inject: bool = Field(default=False, alias="kernel_inject")
    """Inject fused kernels."""
