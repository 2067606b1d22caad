"""``zero_optimization``: ZeRO stage and every knob of it (DeepSpeed 0.19.2 names and defaults)."""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.deprecation import DeprecatedKey
from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.config.fieldtypes import IntOrAuto
from shardspeed.config.offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroLeafModuleConfig",
    "ZeroStageEnum",
    "ZenFlowConfig",
]


class ZeroStageEnum(IntEnum):
    """ZeRO stage; an ``IntEnum``, so ``stage == 3`` and ``stage >= 2`` work."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # alias of ``weights``


DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """``leaf_module``: modules ZeRO-3 gathers as a whole (no hooks inside them)."""

    json_key: ClassVar[str] = "zero_optimization.leaf_module"

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Fully qualified or bare class names."""
    names: list[str] = Field(default_factory=list)
    """Dotted module names (as in ``named_modules()``)."""
    name_suffixes: list[str] = Field(default_factory=list)
    """Module-name suffixes."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ZenFlowConfig(DeepSpeedConfigModel):
    """``zenflow``: ZenFlow selective, overlapped optimizer updates with offload."""

    json_key: ClassVar[str] = "zero_optimization.zenflow"

    topk_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Fraction of important gradient columns updated every step."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """How important columns are re-selected."""
    select_interval: IntOrAuto = "auto"
    """Steps/epochs between re-selections, or ``"auto"``."""
    update_interval: IntOrAuto = "auto"
    """Steps between applying the accumulated unimportant gradients, or ``"auto"``."""
    overlap_step: bool = False
    """Overlap the CPU optimizer step with forward/backward."""
    offload: bool = False
    """Offload selective optimizer states to CPU."""
    auto_ratio: float = Field(default=0.99, ge=0.0, le=1.0)
    """Threshold of the ``"auto"`` update-interval strategy."""
    full_warm_up_rounds: int = 0
    """Initial rounds that update every gradient."""
    pt_reserved_cores_perc: float = Field(default=0.5, ge=0.0, le=1.0)
    """Fraction of CPU cores reserved for PyTorch threads."""
    steps_per_epoch: int | None = Field(default=None, exclude=True)
    """Filled in at run time; not a user setting."""


def _offload_to_cpu(value: Any) -> dict[str, Any] | None:
    return {"device": OffloadDeviceEnum.cpu.value} if value else None


def _migrate_pin_memory(data: dict[str, Any], value: Any) -> None:
    """``cpu_offload_use_pin_memory`` -> ``pin_memory`` of whichever offload sections exist."""
    for key in ("offload_param", "offload_optimizer"):
        section = data.get(key)
        if isinstance(section, dict):
            if section.get("pin_memory") is not None:
                raise DeepSpeedConfigError(
                    f"both the deprecated key 'cpu_offload_use_pin_memory' and "
                    f"'{key}.pin_memory' are given; remove 'cpu_offload_use_pin_memory'."
                )
            data[key] = {**section, "pin_memory": value}
        elif section is not None:
            data[key] = section.model_copy(update={"pin_memory": bool(value)})


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """``zero_optimization``: the ZeRO stage and its bucket, prefetch and offload settings."""

    json_key: ClassVar[str] = "zero_optimization"
    auto_defaults: ClassVar[frozenset[str]] = frozenset(
        {
            "reduce_bucket_size",
            "allgather_bucket_size",
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "model_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "sub_group_size",
        }
    )
    deprecated_keys: ClassVar[tuple[DeprecatedKey, ...]] = (
        DeprecatedKey(
            "cpu_offload",
            ("offload_optimizer",),
            'offload_optimizer: {"device": "cpu"}',
            _offload_to_cpu,
        ),
        DeprecatedKey(
            "cpu_offload_param",
            ("offload_param",),
            'offload_param: {"device": "cpu"}',
            _offload_to_cpu,
        ),
        DeprecatedKey(
            "cpu_offload_use_pin_memory",
            ("offload_param", "offload_optimizer"),
            "offload_param.pin_memory / offload_optimizer.pin_memory",
            migrate=_migrate_pin_memory,
        ),
        DeprecatedKey(
            "stage3_gather_fp16_weights_on_model_save",
            ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
        ),
    )

    stage: ZeroStageEnum = ZeroStageEnum.disabled
    """0 disabled; 1 optimizer states; 2 + gradients; 3 + parameters."""
    contiguous_gradients: bool = True
    """Copy gradients into a contiguous buffer as they are produced. (shardspeed's gradient
    buckets are always contiguous, so both values behave alike.)"""
    reduce_scatter: bool = True
    """Average gradients with reduce/reduce-scatter instead of all-reduce."""
    reduce_bucket_size: int = Field(default=500_000_000, ge=0)
    """Elements reduced at a time."""
    use_multi_rank_bucket_allreduce: bool = True
    """Combine the reduce buckets of different ranks into one all-reduce. (Accepted; shardspeed
    reduces each bucket with one collective either way.)"""
    allgather_partitions: bool = True
    """All-gather (not broadcasts) the updated partitions at step end. (Accepted; the results
    are the same, and shardspeed's gloo all-gather already runs as one broadcast per rank.)"""
    allgather_bucket_size: int = Field(default=500_000_000, ge=0)
    """Elements all-gathered at a time."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; None resolves to ``stage == 3``."""
    load_from_fp32_weights: bool = True
    """Initialize fp32 master weights from the checkpoint's fp32 copies."""
    elastic_checkpoint: bool = False
    """Load a checkpoint saved with a different world size: no longer a DeepSpeed option, and
    shardspeed always can (checkpoints re-partition on load), so either value behaves alike."""
    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    """Parameter offload (stage 3 only)."""
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1-3)."""
    zenflow: ZenFlowConfig | None = None
    """ZenFlow settings; None disables ZenFlow."""
    sub_group_size: int = Field(default=1_000_000_000, ge=0)
    """Tile size for parameter processing with offload."""
    cpu_offload_param: bool | None = None
    """Deprecated: use ``offload_param: {"device": "cpu"}``."""
    cpu_offload_use_pin_memory: bool | None = None
    """Deprecated: use ``offload_param/offload_optimizer.pin_memory``."""
    cpu_offload: bool | None = None
    """Deprecated: use ``offload_optimizer: {"device": "cpu"}``."""
    prefetch_bucket_size: int = Field(default=50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    """Parameter elements fetched ahead of use (stage 3)."""
    param_persistence_threshold: int = Field(
        default=100_000, ge=0, alias="stage3_param_persistence_threshold"
    )
    """Parameters smaller than this stay unpartitioned (stage 3)."""
    model_persistence_threshold: int = Field(
        default=sys.maxsize, ge=0, alias="stage3_model_persistence_threshold"
    )
    """Upper bound on the total persisted (unpartitioned) elements."""
    max_live_parameters: int = Field(
        default=1_000_000_000, ge=0, alias="stage3_max_live_parameters"
    )
    """Gathered parameter elements resident per GPU before releasing."""
    max_reuse_distance: int = Field(default=1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    """Keep a parameter gathered if it is reused within this many parameter elements."""
    gather_16bit_weights_on_model_save: bool = Field(
        default=False, alias="stage3_gather_16bit_weights_on_model_save"
    )
    """Consolidate the 16-bit weights for ``save_16bit_model()``."""
    module_granularity_threshold: int = Field(
        default=0, ge=0, alias="stage3_module_granularity_threshold"
    )
    """Modules below this granularity are fetched as a whole."""
    use_all_reduce_for_fetch_params: bool = Field(
        default=False, alias="stage3_use_all_reduce_for_fetch_params"
    )
    """Fetch stage-3 parameters with all-reduce."""
    allgather_sequential: bool = Field(default=False, alias="stage3_allgather_sequential")
    """All-gather parameters one by one, bypassing buckets."""
    stage3_gather_fp16_weights_on_model_save: bool | None = None
    """Deprecated: use ``gather_16bit_weights_on_model_save``."""
    ignore_unused_parameters: bool = True
    """Do not error on unused parameters (stage 2)."""
    legacy_stage1: bool = False
    """The old stage-1 implementation."""
    round_robin_gradients: bool = False
    """Parallelize gradient copies to CPU across ranks (stages 1/2 with offload, which is not
    yet supported; accepted and without effect)."""
    zero_hpz_partition_size: int = Field(default=1, ge=0)
    """Ranks in the secondary (hpZ) partition group."""
    zero_quantized_weights: bool = False
    """Quantize weights for all-gather (qwZ)."""
    zero_quantized_nontrainable_weights: bool = False
    """Store frozen weights quantized."""
    zero_quantized_gradients: bool = False
    """Quantize gradients for the all-to-all reduce (qgZ)."""
    zeropp_loco_param: dict[str, Any] | None = None
    """LoCo-ZeRO++ settings, e.g. ``{"err_beta": 0.8, "reset_T": 1024}``."""
    mics_shard_size: int = -1
    """MiCS shard group size (-1 disables MiCS)."""
    mics_hierarchical_params_gather: bool = False
    """Two-stage hierarchical all-gather (MiCS)."""
    memory_efficient_linear: bool = True
    """Memory-efficient linear implementation (stage 3)."""
    pipeline_loading_checkpoint: bool = False
    """Pipeline checkpoint loading."""
    override_module_apply: bool = True
    """Gather parameters around ``nn.Module.apply`` (stage 3)."""
    log_trace_cache_warnings: bool = False
    """Log trace-cache warnings such as invalidations."""
    enable_sanity_checks: bool = False
    """Internal sanity checks."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Keep the Muon momentum buffer in memory under NVMe offload."""
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(
        default_factory=DeepSpeedZeroLeafModuleConfig
    )
    """Modules ZeRO-3 treats as leaves."""

    @field_validator("stage", mode="before")
    @classmethod
    def _known_stage(cls, value: Any) -> Any:
        # the enum's own error lists the max_stage alias twice ("0, 1, 2, 3 or 3")
        if isinstance(value, bool) or value not in {0, 1, 2, 3}:
            raise ValueError(
                "expected 0 (disabled), 1 (optimizer states), 2 (+ gradients) or 3 "
                f"(+ parameters), got {value!r}"
            )
        return value

    @field_validator("overlap_comm")
    @classmethod
    def _overlap_default(cls, value: bool | None, info: ValidationInfo) -> bool:
        if value is not None:
            return value
        return info.data.get("stage") == ZeroStageEnum.weights

    @property
    def enabled(self) -> bool:
        """True for stages 1-3."""
        return self.stage > ZeroStageEnum.disabled
