"""The inference config: ``DeepSpeedInferenceConfig`` and its sections, as pydantic models.

Field names, aliases and defaults follow DeepSpeed's ``deepspeed/inference/config.py``; like the
training config, an unknown key is an error that names the closest valid key. Objects that only
code can supply (process groups, an ``mpu``, injection policies keyed by module classes) are
accepted as-is and left out of JSON dumps.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, ClassVar

import torch
from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.deprecation import DeprecatedKey
from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.config.fieldtypes import TorchDType
from shardspeed.config.tensor_parallel import TPConfig
from shardspeed.config.zero import DeepSpeedZeroConfig

__all__ = [
    "ActivationQuantConfig",
    "DeepSpeedInferenceConfig",
    "DeepSpeedMoEConfig",
    "DeepSpeedTPConfig",
    "InferenceCheckpointConfig",
    "MoETypeEnum",
    "QKVQuantConfig",
    "QuantTypeEnum",
    "QuantizationConfig",
    "WeightQuantConfig",
]


class MoETypeEnum(str, Enum):
    """How an inference MoE layer combines experts."""

    residual = "residual"
    standard = "standard"


class QuantTypeEnum(str, Enum):
    """Symmetric (zero point 0) or asymmetric quantization."""

    asym = "asymmetric"
    sym = "symmetric"


class DeepSpeedTPConfig(TPConfig):
    """``tensor_parallel`` (alias ``tp``): how many ranks the model is split across.

    The training section's fields (``tp_size``, ``tp_grain_size``, ``mpu``, ``tp_group``) plus
    ``enabled``; inference splits MLP and lm_head columns in multiples of 64 by default."""

    json_key: ClassVar[str] = "tensor_parallel"

    enabled: bool = True
    """Turn tensor parallelism on."""
    tp_grain_size: int = Field(default=64, gt=0)
    """MLP shards are multiples of this many columns where the size allows."""


class DeepSpeedMoEConfig(DeepSpeedConfigModel):
    """``moe``: expert parallelism for inference MoE layers."""

    json_key: ClassVar[str] = "moe"

    enabled: bool = True
    ep_size: int = Field(default=1, gt=0)
    """Expert-parallel degree."""
    moe_experts: list[int] = Field(default_factory=lambda: [1], alias="num_experts")
    """Global number of experts (per MoE layer)."""
    type: MoETypeEnum = MoETypeEnum.standard
    """``standard`` or ``residual``."""
    ep_mp_group: Any = Field(default=None, exclude=True)
    ep_group: Any = Field(default=None, alias="expert_group", exclude=True)


class _QuantBase(DeepSpeedConfigModel):
    enabled: bool = True
    num_bits: int = Field(default=8, gt=0)
    q_type: QuantTypeEnum = QuantTypeEnum.sym
    q_groups: int = Field(default=1, gt=0)


class ActivationQuantConfig(_QuantBase):
    """``quant.activation`` (activations stay in the compute dtype in shardspeed)."""

    json_key: ClassVar[str] = "quant.activation"


class WeightQuantConfig(_QuantBase):
    """``quant.weight``: the int8 weight format; ``q_groups`` > 1 gives group-wise scales."""

    json_key: ClassVar[str] = "quant.weight"

    quantized_initialization: dict[str, Any] = Field(default_factory=dict)
    post_init_quant: dict[str, Any] = Field(default_factory=dict)


class QKVQuantConfig(DeepSpeedConfigModel):
    """``quant.qkv``."""

    json_key: ClassVar[str] = "quant.qkv"

    enabled: bool = True


class QuantizationConfig(DeepSpeedConfigModel):
    """``quant``: weight-only int8 quantization, applied when ``dtype`` is int8."""

    json_key: ClassVar[str] = "quant"

    enabled: bool = True
    activation: ActivationQuantConfig = Field(default_factory=ActivationQuantConfig)
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    qkv: QKVQuantConfig = Field(default_factory=QKVQuantConfig)


class InferenceCheckpointConfig(DeepSpeedConfigModel):
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    json_key: ClassVar[str] = "checkpoint_config"

    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


def _migrate_mp_size(data: dict[str, Any], value: Any) -> None:
    if value == 1:  # the default: nothing to move
        return
    tp = data.get("tensor_parallel", data.get("tp"))
    tp = dict(tp) if isinstance(tp, dict) else ({} if tp is None else tp.model_dump())
    given = tp.get("tp_size")
    if given is not None and given != value:
        raise DeepSpeedConfigError(
            f"mp_size={value} conflicts with tensor_parallel.tp_size={given}; mp_size is "
            "deprecated, remove it and keep tensor_parallel.tp_size."
        )
    tp["tp_size"] = value
    data.pop("tp", None)
    data["tensor_parallel"] = tp


class DeepSpeedInferenceConfig(DeepSpeedConfigModel):
    """The config of :func:`shardspeed.init_inference`."""

    json_key: ClassVar[str] = ""
    deprecated_keys: ClassVar[tuple[DeprecatedKey, ...]] = (
        DeprecatedKey(
            "mp_size",
            ("tensor_parallel", "tp"),
            "tensor_parallel.tp_size",
            migrate=_migrate_mp_size,
        ),
    )

    replace_with_kernel_inject: bool = Field(default=False, alias="kernel_inject")
    """Replace supported decoder blocks with fused ones (one QKV matmul, SDPA, static KV cache)."""
    dtype: TorchDType = torch.float16
    """Weight dtype: fp32, fp16, bf16, or int8 (weight-only int8 with per-channel scales)."""
    tensor_parallel: DeepSpeedTPConfig = Field(default_factory=DeepSpeedTPConfig, alias="tp")
    enable_cuda_graph: bool = False
    """Capture the fused decode step as a CUDA graph and replay it (CUDA only)."""
    use_triton: bool = False
    triton_autotune: bool = False
    zero: DeepSpeedZeroConfig = Field(default_factory=DeepSpeedZeroConfig)
    triangular_masking: bool = Field(default=True, alias="tm")
    moe: bool | DeepSpeedMoEConfig = Field(default_factory=DeepSpeedMoEConfig)
    keep_module_on_host: bool = False
    """Leave the sharded weights on the host instead of moving them to the accelerator."""
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: str | dict[str, Any] | None = None
    """A checkpoint to load shard by shard: a directory of safetensors files, a safetensors
    index or file, a JSON load policy (``{"checkpoints": [...], "type": ...}``) or its path."""
    base_dir: str = ""
    """Directory the files named in ``checkpoint`` are relative to."""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: InferenceCheckpointConfig = Field(
        default_factory=InferenceCheckpointConfig, alias="ckpt_config"
    )
    return_tuple: bool = True
    """Fused blocks return a tuple (as Hugging Face layers do) rather than a tensor."""
    training_mp_size: int = Field(default=1, gt=0)
    replace_method: str = "auto"
    injection_policy: dict[Any, Any] | None = Field(
        default=None, alias="injection_dict", exclude=True
    )
    """``{block class: (names of its row-parallel linears)}`` for models AutoTP does not know."""
    injection_policy_tuple: tuple[Any, ...] | None = Field(default=None, exclude=True)
    config: dict[str, Any] | None = Field(default=None, alias="args")
    max_out_tokens: int = Field(default=1024, alias="max_tokens", gt=0)
    """Prompt + generated tokens the fused decoder's KV cache holds."""
    min_out_tokens: int = Field(default=1, alias="min_tokens", gt=0)
    """Fewest tokens the KV cache must hold; below it initialisation fails."""
    transposed_mode: bool = False
    mp_size: int = Field(default=1, gt=0)
    """Deprecated: use ``tensor_parallel.tp_size``."""
    mpu: Any = Field(default=None, exclude=True)
    ep_size: int = Field(default=1, gt=0)
    ep_group: Any = Field(default=None, alias="expert_group", exclude=True)
    ep_mp_group: Any = Field(default=None, alias="expert_mp_group", exclude=True)
    moe_experts: list[int] = Field(default_factory=lambda: [1])
    moe_type: MoETypeEnum = MoETypeEnum.standard
