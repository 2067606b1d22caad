"""What an engine is made of, built by :func:`shardspeed.runtime.assembly.assemble` and handed
to :class:`~shardspeed.runtime.engine.DeepSpeedEngine`, which only composes them; and the
stand-in for the optimizer of an engine built without one."""

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


class NoOptimizer:
    """Stands in for the optimizer wrapper of an engine built without an optimizer: queries
    answer "nothing", the verbs that need an optimizer say so."""

    param_groups: list[dict[str, Any]] = []
    loss_scale = 1.0
    global_grad_norm: float | None = None

    @staticmethod
    def require(verb: str) -> None:
        raise RuntimeError(
            f"engine.{verb} needs an optimizer: pass optimizer= to initialize() or add an "
            "'optimizer' section to the config"
        )

    @staticmethod
    def scale_loss(loss: torch.Tensor) -> torch.Tensor:
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none

    def step(self) -> bool:
        self.require("step()")
        return False


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
    #: what AutoTP training split (None without ``tensor_parallel.autotp_size``)
    tensor_parallel: Any = None
    args: Any = None
    mpu: Any = None
    collate_fn: Any = None
