"""``DeepSpeedConfig`` attributes, defaults, every top-level section, and the public shims."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import shardspeed
from shardspeed.config import DeepSpeedConfig, OffloadDeviceEnum, ZeroStageEnum
from shardspeed.config.root import RootConfig


def _cfg(**extra: Any) -> DeepSpeedConfig:
    return DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **extra}, dp_world_size=1)


def test_defaults_match_deepspeed_0_19_2() -> None:
    cfg = _cfg()
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print is None
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.communication_data_type is None
    assert cfg.seq_parallel_communication_data_type == torch.float32
    assert cfg.zero_force_ds_cpu_optimizer is True and cfg.zero_allow_untested_optimizer is False
    assert cfg.fp16.loss_scale == 0 and cfg.fp16.initial_scale_power == 16
    assert cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    assert cfg.fp16.min_loss_scale == 1
    assert cfg.bf16.check_grad_overflow is False and cfg.bf16.immediate_grad_update is False
    zero = cfg.zero_optimization
    assert zero.stage == 0 and isinstance(zero.stage, ZeroStageEnum)
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert zero.prefetch_bucket_size == 50_000_000 and zero.param_persistence_threshold == 100_000
    assert zero.overlap_comm is False and zero.offload_param is None
    assert cfg.comms_logger.prof_all is True and cfg.comms_logger.prof_ops == []
    assert cfg.tensorboard.job_name == "DeepSpeedJobName" and cfg.wandb.project == "deepspeed"
    assert cfg.flops_profiler.profile_step == 1 and cfg.flops_profiler.detailed is True
    assert cfg.pipeline.stages == "auto" and cfg.pipeline.partition == "best"
    assert cfg.checkpoint.tag_validation == "WARN" and cfg.checkpoint.load_universal is False
    assert cfg.activation_checkpointing.number_checkpoints is None
    assert cfg.aio.block_size == 1_048_576 and cfg.aio.queue_depth == 8
    assert cfg.timers.throughput.enabled is True


def test_zero_stage_enum() -> None:
    assert ZeroStageEnum.max_stage == ZeroStageEnum.weights == 3
    assert [int(s) for s in ZeroStageEnum] == [0, 1, 2, 3]
    cfg = _cfg(
        zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}
    )
    assert cfg.zero_optimization.stage == 3 and cfg.zero_optimization.stage >= 2
    assert cfg.zero_enabled and cfg.zero_optimization_stage == 3
    assert cfg.zero_optimization.overlap_comm is True
    assert cfg.zero_optimization.offload_param.device == OffloadDeviceEnum.nvme == "nvme"  # type: ignore[union-attr]


def test_precision_properties() -> None:
    assert _cfg(fp16={"enabled": True}).fp16_enabled
    cfg = _cfg(bf16={"enabled": True})
    assert cfg.bfloat16_enabled and not cfg.fp16_enabled and cfg.precision_dtype == torch.bfloat16
    auto = _cfg(torch_autocast={"enabled": True, "dtype": "bfloat16"}).torch_autocast
    assert auto.enabled and auto.dtype == torch.bfloat16
    assert "torch.nn.Linear" in auto.resolved_lower_precision_safe_modules


def test_optimizer_and_scheduler_sections() -> None:
    cfg = _cfg(
        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    )
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.99]}
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {
        "lr": 1e-3,
        "betas": [0.9, 0.99],
    }
    assert cfg.scheduler_name == "WarmupLR" and cfg.scheduler_params == {"warmup_num_steps": 10}
    assert _cfg(optimizer={"type": "SGD", "params": {"lr": 1}}).optimizer_name == "SGD"


EVERY_SECTION: dict[str, Any] = {
    "train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10,
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "gradient_predivide_factor": 2.0,
    "gradient_allreduce_op": "mean",
    "communication_data_type": "bf16",
    "seq_parallel_communication_data_type": "fp16",
    "sparse_gradients": False,
    "disable_allgather": False,
    "dump_state": False,
    "memory_breakdown": False,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "graph_harvesting": False,
    "dataloader_drop_last": True,
    "use_data_before_expert_parallelism": False,
    "sequence_parallel_size": 1,
    "data_parallel_size": 1,
    "vocabulary_size": 32000,
    "amp": {"enabled": False, "opt_level": "O1"},
    "data_types": {"grad_accum_dtype": "fp32"},
    "sparse_attention": {"mode": "bigbird", "block": 32, "num_random_blocks": 2},
    "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001},
    "eigenvalue": {"enabled": False, "max_iter": 50},
    "elasticity": {"enabled": False, "micro_batch_sizes": [1, 2]},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
    "data_efficiency": {"enabled": False, "data_sampling": {"enabled": False}},
    "curriculum_learning": {"enabled": False},
    "hybrid_engine": {"enabled": False, "max_out_tokens": 256},
    "autotuning": {"enabled": False, "metric": "latency"},
    "aio": {"block_size": 4096, "use_gds": False},
    "nebula": {"enabled": False},
    "datastates": {"enabled": False},
    "checkpoint": {"tag_validation": "fail", "writer": {"type": "python"}},
    "tensor_parallel": {
        "autotp_size": 2,
        "preset_model": "llama",
        "partition_config": {"use_default_specs": False},
    },
    "expert_parallel": {"enabled": False, "autoep_size": 1, "top_k": 2},
    "compile": {"deepcompile": False, "passes": ["z3"]},
    "timers": {"throughput": {"enabled": False}},
    "pipeline": {"stages": 2, "activation_checkpoint_interval": 1},
    "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4},
    "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
    "flops_profiler": {"enabled": True, "output_file": "flops.txt"},
    "tensorboard": {"enabled": True},
    "wandb": {"enabled": False, "team": "t"},
    "comet": {"enabled": False, "mode": "create"},
    "csv_monitor": {"enabled": True, "output_path": "/tmp/csv"},
    "weight_quantization": {"quantized_initialization": {}},
}


def test_every_top_level_section_is_accepted() -> None:
    cfg = DeepSpeedConfig(EVERY_SECTION, dp_world_size=1)
    assert cfg.amp.params == {"opt_level": "O1"}
    assert cfg.data_types.grad_accum_dtype == torch.float32
    assert cfg.checkpoint.tag_validation_fail and cfg.checkpoint.writer.type == "PYTHON"  # type: ignore[union-attr]
    assert cfg.tensor_parallel.autotp_size == 2 and cfg.pipeline.stages == 2
    assert cfg.wall_clock_breakdown_enabled  # the FLOPs profiler turns it on
    assert cfg.monitor_config.enabled and cfg.monitor_config.csv_monitor.output_path == "/tmp/csv"
    assert cfg.compression_training is not None and cfg.data_efficiency is not None
    untested = (
        set(RootConfig.model_fields)
        - set(EVERY_SECTION)
        - {
            "train_micro_batch_size_per_gpu",
            "optimizer",
            "scheduler",
            "zero_optimization",
            "fp16",
            "bf16",
            "torch_autocast",
            "allgather_size",
            "quantize_training",
        }
    )
    assert untested == set()


def test_repr_and_print_dump_resolved_config(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(zero_optimization={"stage": 2}, communication_data_type="fp16")
    text = repr(cfg)
    assert '"stage3_prefetch_bucket_size": 50000000' in text
    assert '"communication_data_type": "float16"' in text and '"dp_world_size": 1' in text
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardspeed").addHandler(handler)
    try:
        cfg.print("ds")
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)
    assert records[0] == "ds:" and any("zero_optimization" in r for r in records)


def test_public_paths_and_shims() -> None:
    from shardspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from shardspeed.runtime.config import DeepSpeedConfig as RuntimeConfig
    from shardspeed.runtime.config import DeepSpeedConfigError
    from shardspeed.runtime.config_utils import DeepSpeedConfigModel
    from shardspeed.runtime.zero.config import (
        DeepSpeedZeroConfig,
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    assert RuntimeConfig is shardspeed.DeepSpeedConfig is DeepSpeedConfig
    assert DeepSpeedConfigError is shardspeed.DeepSpeedConfigError
    for model in (
        CometConfig,
        CSVConfig,
        TensorBoardConfig,
        WandbConfig,
        DeepSpeedZeroConfig,
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    ):
        assert issubclass(model, DeepSpeedConfigModel)
    assert DeepSpeedZeroConfig(stage=1).overlap_comm is False  # type: ignore[arg-type]
    assert DeepSpeedZeroConfig(stage=3).overlap_comm is True  # type: ignore[arg-type]
    assert DeepSpeedZeroConfig(stage=3, overlap_comm=False).overlap_comm is False  # type: ignore[arg-type]


def test_config_layer_imports_nothing_above_layer_0() -> None:
    import ast
    from pathlib import Path

    package = Path(shardspeed.__file__).parent / "config"
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("shardspeed")
            ):
                assert node.module.startswith(("shardspeed.config", "shardspeed.utils.logging")), (
                    f"{source.name} imports {node.module}"
                )


def test_aio_thread_count_is_intra_op_parallelism():
    """DeepSpeed's documented ``aio.thread_count`` (the older name) sets the I/O threads."""
    from shardspeed.config import DeepSpeedConfig

    base = {"train_micro_batch_size_per_gpu": 1}
    assert DeepSpeedConfig({**base, "aio": {"thread_count": 3}}).aio.intra_op_parallelism == 3
    assert (
        DeepSpeedConfig({**base, "aio": {"intra_op_parallelism": 2}}).aio.intra_op_parallelism == 2
    )
