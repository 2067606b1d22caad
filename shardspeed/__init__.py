"""shardspeed: DeepSpeed's training API and JSON config, in pure Python on PyTorch.

``import shardspeed as deepspeed`` is meant to work unchanged. Heavy names are loaded on first
use (PEP 562), so ``import shardspeed`` and the launcher start fast and import no runtime module.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardspeed.utils.logging import log_dist, logger
from shardspeed.version import (
    __git_branch__,
    __git_hash__,
    __version__,
    __version_major__,
    __version_minor__,
    __version_patch__,
)

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "initialize": "shardspeed.runtime.initialize",
    "init_inference": "shardspeed.inference.entry",
    "default_inference_config": "shardspeed.inference.entry",
    "init_distributed": "shardspeed.comm",
    "add_config_arguments": "shardspeed.runtime.arguments",
    "add_tuning_arguments": "shardspeed.runtime.lr_schedules",
    "DeepSpeedEngine": "shardspeed.runtime.engine",
    "PipelineEngine": "shardspeed.runtime.pipe.engine",
    "PipelineModule": "shardspeed.runtime.pipe.module",
    "pipe": "shardspeed.pipe",
    "DeepSpeedConfig": "shardspeed.runtime.config",
    "DeepSpeedConfigError": "shardspeed.config.errors",
    "OnDevice": "shardspeed.utils.init_on_device",
    "tp_model_init": "shardspeed.runtime.tensor_parallel.legacy",
    "set_autotp_mode": "shardspeed.runtime.tensor_parallel.legacy",
    "set_optimizer_flags": "shardspeed.ops.muon.tagging",
    "MUON_OPTIMIZER": "shardspeed.ops.muon.tagging",
    "comm": "shardspeed.comm",
    "checkpointing": "shardspeed.checkpointing",
    "accelerator": "shardspeed.accelerator",
    "get_accelerator": "shardspeed.accelerator",
    "ops": "shardspeed.ops",
    "runtime": "shardspeed.runtime",
    "utils": "shardspeed.utils",
    # subpackages DeepSpeed users reach through the top-level module
    "zero": "shardspeed.zero",
    "checkpoint": "shardspeed.checkpoint",
    "monitor": "shardspeed.monitor",
    "profiling": "shardspeed.profiling",
    "inference": "shardspeed.inference",
    "launcher": "shardspeed.launcher",
    "moe": "shardspeed.moe",
    "sequence": "shardspeed.sequence",
    "elasticity": "shardspeed.elasticity",
    "module_inject": "shardspeed.module_inject",
}

__all__ = [
    "__version__",
    "__version_major__",
    "__version_minor__",
    "__version_patch__",
    "__git_hash__",
    "__git_branch__",
    "log_dist",
    "logger",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'shardspeed' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"shardspeed.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
