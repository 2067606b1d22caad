"""Pydantic models of every DeepSpeed config section, the batch triangle and config loading.

Layer 0: imports only pydantic, hjson, torch and ``shardspeed.utils.logging``.
"""

from shardspeed.config.activation_checkpointing import DeepSpeedActivationCheckpointingConfig
from shardspeed.config.aio import AioConfig
from shardspeed.config.auto import AUTO, is_auto, reject_auto, resolve_auto
from shardspeed.config.autotuning import DeepSpeedAutotuningConfig
from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.batch import solve_batch_triangle
from shardspeed.config.checkpoint import (
    CheckpointConfig,
    CheckpointParallelWriteConfig,
    CheckpointWriterConfig,
    DeepSpeedNebulaConfig,
)
from shardspeed.config.comms import DeepSpeedCommsConfig
from shardspeed.config.deepcompile import CompileConfig
from shardspeed.config.deprecation import DeprecatedKey
from shardspeed.config.ds_config import DeepSpeedConfig, resolve_dp_world_size
from shardspeed.config.eigenvalue import EigenvalueConfig
from shardspeed.config.elasticity import ElasticityConfig
from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.config.expert_parallel import ExpertParallelConfig
from shardspeed.config.fieldtypes import DTYPE_NAMES, parse_dtype, parse_float_dtype
from shardspeed.config.flops_profiler import DeepSpeedFlopsProfilerConfig
from shardspeed.config.hybrid_engine import HybridEngineConfig
from shardspeed.config.loader import config_source_from_args, load_config_dict, parse_config_text
from shardspeed.config.monitor import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from shardspeed.config.offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)
from shardspeed.config.optimizer import (
    DEEPSPEED_OPTIMIZERS,
    DEEPSPEED_SCHEDULERS,
    OptimizerConfig,
    SchedulerConfig,
)
from shardspeed.config.pipeline import PipelineConfig
from shardspeed.config.precision import (
    DEFAULT_LOWER_PRECISION_SAFE_MODULES,
    DataTypesConfig,
    DeepSpeedAmpConfig,
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    TorchAutocastConfig,
)
from shardspeed.config.progressive_layer_drop import ProgressiveLayerDropConfig
from shardspeed.config.root import RootConfig
from shardspeed.config.sparse_attention import SparseAttentionConfig
from shardspeed.config.tensor_parallel import TPConfig, TPTrainingConfig
from shardspeed.config.timers import ThroughputTimerConfig, TimersConfig
from shardspeed.config.zero import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroLeafModuleConfig,
    ZenFlowConfig,
    ZeroStageEnum,
)

__all__ = [
    "AUTO",
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "DEFAULT_LOWER_PRECISION_SAFE_MODULES",
    "DTYPE_NAMES",
    "AioConfig",
    "CSVConfig",
    "CheckpointConfig",
    "CheckpointParallelWriteConfig",
    "CheckpointWriterConfig",
    "CometConfig",
    "CompileConfig",
    "DataTypesConfig",
    "DeepSpeedActivationCheckpointingConfig",
    "DeepSpeedAmpConfig",
    "DeepSpeedAutotuningConfig",
    "DeepSpeedBF16Config",
    "DeepSpeedCommsConfig",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedConfigModel",
    "DeepSpeedFP16Config",
    "DeepSpeedFlopsProfilerConfig",
    "DeepSpeedMonitorConfig",
    "DeepSpeedNebulaConfig",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroLeafModuleConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "DeprecatedKey",
    "EigenvalueConfig",
    "ElasticityConfig",
    "ExpertParallelConfig",
    "HybridEngineConfig",
    "OffloadDeviceEnum",
    "OptimizerConfig",
    "PipelineConfig",
    "ProgressiveLayerDropConfig",
    "RootConfig",
    "SchedulerConfig",
    "SparseAttentionConfig",
    "TPConfig",
    "TPTrainingConfig",
    "TensorBoardConfig",
    "ThroughputTimerConfig",
    "TimersConfig",
    "TorchAutocastConfig",
    "WandbConfig",
    "ZenFlowConfig",
    "ZeroStageEnum",
    "config_source_from_args",
    "is_auto",
    "load_config_dict",
    "parse_config_text",
    "parse_dtype",
    "parse_float_dtype",
    "reject_auto",
    "resolve_auto",
    "resolve_dp_world_size",
    "solve_batch_triangle",
]
