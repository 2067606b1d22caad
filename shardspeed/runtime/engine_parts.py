"""What an engine is made of, built by :func:`shardspeed.runtime.assembly.assemble` and handed
to :class:`~shardspeed.runtime.engine.DeepSpeedEngine`, which only composes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.dataloader import DeepSpeedDataLoader
from shardspeed.runtime.engine_monitoring import EngineObservability
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.runtime.train_state import TrainState
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.optimizer import ZeroOptimizer
from shardspeed.runtime.zero.strategy import ZeroStrategy


@dataclass
class EngineParts:
    """The parts of one engine (see the module docstring)."""

    config: DeepSpeedConfig
    module: nn.Module
    device: torch.device
    precision: PrecisionPolicy
    #: the data-parallel group and this rank's place in it
    data_parallel: CommGroup
    global_rank: int
    #: how state is split across ranks (always present, also with no optimizer)
    strategy: ZeroStrategy
    #: the wrapped optimizer (loss scaling, overflow, clipping); None without an optimizer
    optimizer: ZeroOptimizer | None
    #: the torch optimizer the config or the caller gave (None without one)
    basic_optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    training_dataloader: DeepSpeedDataLoader | None
    observability: EngineObservability
    state: TrainState
    #: the rank grid, when shardspeed built it (None when ``mpu`` gave the groups)
    topology: Any = None
    args: Any = None
    mpu: Any = None
    collate_fn: Any = None
