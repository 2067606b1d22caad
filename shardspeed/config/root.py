"""``RootConfig``: every top-level key of a DeepSpeed training config, validated as one model.

Sections with a known schema are models; sections whose contents DeepSpeed treats as free-form
(or that shardspeed does not model yet: ``weight_quantization``, ``quantize_training``,
``datastates``) are
plain dicts, so later features can consume them.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from pydantic import AliasChoices, Field, field_validator, model_validator

from shardspeed.config.activation_checkpointing import DeepSpeedActivationCheckpointingConfig
from shardspeed.config.aio import AioConfig
from shardspeed.config.autotuning import DeepSpeedAutotuningConfig
from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.checkpoint import CheckpointConfig, DeepSpeedNebulaConfig
from shardspeed.config.comms import DeepSpeedCommsConfig
from shardspeed.config.compression import CompressionTrainingConfig
from shardspeed.config.data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig
from shardspeed.config.deepcompile import CompileConfig
from shardspeed.config.deprecation import DeprecatedKey
from shardspeed.config.eigenvalue import EigenvalueConfig
from shardspeed.config.elasticity import ElasticityConfig
from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.config.expert_parallel import ExpertParallelConfig
from shardspeed.config.fieldtypes import FloatDType
from shardspeed.config.flops_profiler import DeepSpeedFlopsProfilerConfig
from shardspeed.config.hybrid_engine import HybridEngineConfig
from shardspeed.config.monitor import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from shardspeed.config.optimizer import OptimizerConfig, SchedulerConfig
from shardspeed.config.pipeline import PipelineConfig
from shardspeed.config.precision import (
    DataTypesConfig,
    DeepSpeedAmpConfig,
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    TorchAutocastConfig,
)
from shardspeed.config.progressive_layer_drop import ProgressiveLayerDropConfig
from shardspeed.config.sparse_attention import SparseAttentionConfig
from shardspeed.config.tensor_parallel import TPTrainingConfig
from shardspeed.config.timers import TimersConfig
from shardspeed.config.zero import DeepSpeedZeroConfig
from shardspeed.config.zero_rules import check_config_rules
from shardspeed.utils.logging import logger

__all__ = ["RootConfig"]

_FreeForm = dict[str, Any] | None

#: ``gradient_allreduce_op`` values: average the data-parallel gradients, or add them
GRADIENT_ALLREDUCE_OPS = ("mean", "sum")


def _legacy_zero_section(data: dict[str, Any]) -> None:
    """``"zero_optimization": true|false`` (pre-dict form) -> ``{"stage": 1|0}``."""
    value = data.get("zero_optimization")
    if not isinstance(value, bool):
        return
    stage = 1 if value else 0
    logger.warning(
        f"Config 'zero_optimization: {str(value).lower()}' is deprecated; use "
        f"'zero_optimization: {{\"stage\": {stage}}}' instead."
    )
    data["zero_optimization"] = {"stage": stage}


def _migrate_allgather_size(data: dict[str, Any], value: Any) -> None:
    """Top-level ``allgather_size`` (legacy ZeRO form) -> ``zero_optimization.allgather_bucket_size``."""
    zero = data.get("zero_optimization")
    zero = {} if zero is None else zero
    if isinstance(zero, dict):
        if zero.get("allgather_bucket_size") is not None:
            raise DeepSpeedConfigError(
                "both the deprecated key 'allgather_size' and "
                "'zero_optimization.allgather_bucket_size' are given; remove 'allgather_size'."
            )
        data["zero_optimization"] = {**zero, "allgather_bucket_size": value}


class RootConfig(DeepSpeedConfigModel):
    """The whole DeepSpeed config, each section under its DeepSpeed JSON key."""

    deprecated_keys: ClassVar[tuple[DeprecatedKey, ...]] = (
        DeprecatedKey(
            "allgather_size",
            ("zero_optimization",),
            "zero_optimization.allgather_bucket_size",
            migrate=_migrate_allgather_size,
        ),
    )
    auto_defaults: ClassVar[frozenset[str]] = frozenset(
        {
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "gradient_clipping",
            "steps_per_print",
        }
    )

    # batch triangle (solved by DeepSpeedConfig)
    train_batch_size: int | None = None
    """Global batch size per optimizer step."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per device per forward/backward."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches accumulated per optimizer step."""

    # optimization
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = Field(default=0.0, ge=0.0)
    """Clip the global gradient norm to this (0 disables; 0.19.2 default)."""
    prescale_gradients: bool = False
    """Scale gradients before the all-reduce instead of after."""
    gradient_predivide_factor: float = Field(default=1.0, gt=0.0)
    """Divide gradients by this before the all-reduce, the rest after."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """Combine data-parallel gradients by their mean or their plain sum (any case accepted)."""
    communication_data_type: FloatDType | None = None
    """Dtype of gradient communication (None: follow the model dtype)."""
    seq_parallel_communication_data_type: FloatDType | None = torch.float32
    """Dtype of sequence-parallel gradient communication."""
    sparse_gradients: bool = False
    """Communicate embedding gradients sparsely (CSR)."""
    disable_allgather: bool = False
    """Broadcast instead of all-gather."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer with ZeRO."""
    zero_force_ds_cpu_optimizer: bool = True
    """Require the DeepSpeed CPU optimizer under optimizer offload."""
    zero_optimization: DeepSpeedZeroConfig = Field(default_factory=DeepSpeedZeroConfig)
    graph_harvesting: bool = False
    """Capture short kernel sequences as graphs."""

    # precision
    fp16: DeepSpeedFP16Config = Field(default_factory=DeepSpeedFP16Config)
    bf16: DeepSpeedBF16Config = Field(
        default_factory=DeepSpeedBF16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    amp: DeepSpeedAmpConfig = Field(default_factory=DeepSpeedAmpConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)

    # logging, monitoring, profiling
    steps_per_print: int | None = Field(default=None, gt=0)
    """Log progress every this many steps (None or infinity: never)."""
    wall_clock_breakdown: bool = False
    """Time forward, backward, reduction and step."""
    memory_breakdown: bool = False
    """Log memory use at each phase."""
    dump_state: bool = False
    """Print the engine state after initialization."""
    comms_logger: DeepSpeedCommsConfig = Field(default_factory=DeepSpeedCommsConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    flops_profiler: DeepSpeedFlopsProfilerConfig = Field(
        default_factory=DeepSpeedFlopsProfilerConfig
    )
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    autotuning: DeepSpeedAutotuningConfig = Field(default_factory=DeepSpeedAutotuningConfig)

    # memory and checkpoints
    activation_checkpointing: DeepSpeedActivationCheckpointingConfig = Field(
        default_factory=DeepSpeedActivationCheckpointingConfig
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    nebula: DeepSpeedNebulaConfig = Field(default_factory=DeepSpeedNebulaConfig)
    datastates: _FreeForm = None

    # parallelism
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor_parallel: TPTrainingConfig = Field(default_factory=TPTrainingConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    use_data_before_expert_parallelism: bool = False
    """Order expert-data groups data-first."""
    sequence_parallel_size: int | None = Field(default=None, gt=0)
    """Sequence-parallel degree; divides the world size to give the data-parallel size."""
    data_parallel_size: int | None = Field(default=None, gt=0)
    """Data-parallel degree of the (data, sequence) device mesh."""

    # training features
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch."""
    vocabulary_size: int | None = Field(default=None, gt=0)
    """Vocabulary size (only checked for tensor-core alignment)."""
    sparse_attention: SparseAttentionConfig | None = None
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(
        default_factory=ProgressiveLayerDropConfig
    )
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    compression_training: CompressionTrainingConfig | None = None
    """Compression-aware training (``shardspeed.compression``); None when absent."""
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    curriculum_learning: LegacyCurriculumConfig = Field(default_factory=LegacyCurriculumConfig)
    weight_quantization: _FreeForm = None
    quantize_training: _FreeForm = None

    # legacy
    allgather_size: int | None = None
    """Deprecated: use ``zero_optimization.allgather_bucket_size``."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_top_level(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "bf16" in data and "bfloat16" in data:
            raise DeepSpeedConfigError(
                "both 'bf16' and its legacy name 'bfloat16' are given; keep only 'bf16'."
            )
        data = dict(data)
        _legacy_zero_section(data)
        return data

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinite_means_never(cls, value: Any) -> Any:
        # Accelerate writes float("inf") to turn DeepSpeed's progress lines off
        if isinstance(value, float) and math.isinf(value) and value > 0:
            return None
        return value

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op_any_case(cls, value: Any) -> Any:
        # DeepSpeed lower-cases the value ("SUM" is "sum") and names the key when it is unknown
        op = value.lower() if isinstance(value, str) else value
        if op not in GRADIENT_ALLREDUCE_OPS:
            raise ValueError(
                f"Invalid gradient_allreduce_op {value!r}; supported operations: "
                f"{list(GRADIENT_ALLREDUCE_OPS)} ('mean' averages the data-parallel gradients, "
                "'sum' adds them)"
            )
        return op

    @model_validator(mode="after")
    def _cross_section_checks(self) -> RootConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise DeepSpeedConfigError(
                "fp16.enabled and bf16.enabled are both true; bfloat16 and fp16 modes cannot be "
                "enabled together. Disable one of them."
            )
        check_config_rules(self)
        return self
