"""Every DeepSpeed import path third-party code relies on resolves under shardspeed."""

from __future__ import annotations

import importlib

import pytest

PATHS = [
    ("git_version_info", ("version", "git_hash", "git_branch", "installed_ops", "compatible_ops")),
    ("git_version_info", ("torch_info",)),
    ("ops", ("__compatible_ops__",)),
    ("ops.op_builder", ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder", "ALL_OPS")),
    ("ops.adam", ("DeepSpeedCPUAdam", "FusedAdam")),
    ("ops.adagrad", ("DeepSpeedCPUAdagrad",)),
    ("ops.lion", ("DeepSpeedCPULion", "FusedLion")),
    ("accelerator", ("get_accelerator", "is_current_accelerator_supported")),
    ("utils.torch", ("required_torch_version",)),
    ("utils.numa", ("parse_range_list",)),
    ("utils.groups", ("_get_data_parallel_world_size", "_get_sequence_parallel_world_size")),
    ("utils", ("set_z3_leaf_modules",)),
    ("runtime.utils", ("set_random_seed", "move_to_device", "see_memory_usage")),
    ("runtime.config", ("DeepSpeedConfig",)),
    (
        "runtime.zero.config",
        (
            "DeepSpeedZeroConfig",
            "DeepSpeedZeroOffloadOptimizerConfig",
            "DeepSpeedZeroOffloadParamConfig",
        ),
    ),
    ("runtime.precision_config", ("get_bfloat16_config",)),
    ("runtime.bf16_optimizer", ("BF16_Optimizer",)),
    ("runtime.fp16.fused_optimizer", ("FP16_Optimizer",)),
    ("runtime.fp16.unfused_optimizer", ("FP16_UnfusedOptimizer",)),
    ("runtime.zero.stage_1_and_2", ("DeepSpeedZeroOptimizer",)),
    ("runtime.zero.utils", ("ZeRORuntimeException",)),
    ("checkpoint.utils", ("get_model_ckpt_name_for_rank", "clone_tensors_for_torch_save")),
    ("launcher.runner", ("parse_resource_filter", "_parse_hostfile", "DEEPSPEED_ENVIRONMENT_NAME")),
    ("launcher.multinode_runner", ("MultiNodeRunner",)),
    ("monitor.csv_monitor", ("csvMonitor",)),
    ("monitor.tensorboard", ("TensorBoardMonitor",)),
    ("monitor.wandb", ("WandbMonitor",)),
    ("monitor.comet", ("CometMonitor",)),
    ("monitor.config", ("DeepSpeedMonitorConfig",)),
    ("runtime.engine", ("DeepSpeedEngine",)),
    ("comm", ("init_distributed", "get_rank")),
]


@pytest.mark.parametrize(("module", "names"), PATHS, ids=[m for m, _ in PATHS])
def test_path_imports(module: str, names: tuple[str, ...]) -> None:
    imported = importlib.import_module(f"shardspeed.{module}")
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"shardspeed.{module} lacks {missing}"
