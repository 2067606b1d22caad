"""Choosing the basic optimizer and LR scheduler: a client object or callable wins over the config,
as in DeepSpeed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.ops.factory import build_optimizer
from shardspeed.runtime.lr_schedules import scheduler_from_config
from shardspeed.utils.logging import log_dist


def build_basic_optimizer(
    client_optimizer: Any, model_parameters: Iterable[Any], config: Any
) -> torch.optim.Optimizer | None:
    """The torch optimizer the ZeRO strategy will drive (None for an inference-only engine)."""
    if client_optimizer is not None:
        if config.optimizer is not None:
            log_dist(
                "client optimizer given to initialize(); ignoring the config's 'optimizer'", [0]
            )
        if isinstance(client_optimizer, torch.optim.Optimizer):
            return client_optimizer
        if callable(client_optimizer):
            return client_optimizer(model_parameters)
        raise TypeError(
            "initialize(optimizer=...) must be a torch.optim.Optimizer or a callable that takes the "
            f"model parameters and returns one; got {type(client_optimizer).__name__}"
        )
    if config.optimizer is None:
        return None
    return build_optimizer(config.optimizer.type, model_parameters, dict(config.optimizer.params))


def build_lr_scheduler(client_scheduler: Any, config: Any, optimizer: Any) -> Any:
    """The per-step LR scheduler: a client object, a client callable applied to the optimizer,
    the config's ``scheduler`` section, or None."""
    if client_scheduler is not None:
        if config.scheduler is not None:
            log_dist(
                "client lr_scheduler given to initialize(); ignoring the config's 'scheduler'", [0]
            )
        if hasattr(client_scheduler, "step") and hasattr(client_scheduler, "state_dict"):
            return client_scheduler
        if callable(client_scheduler):
            return client_scheduler(optimizer)
        raise TypeError(
            "initialize(lr_scheduler=...) must be a scheduler object or a callable that takes the "
            f"optimizer and returns one; got {type(client_scheduler).__name__}"
        )
    if config.scheduler is None or optimizer is None:
        return None
    return scheduler_from_config(config.scheduler.type, optimizer, dict(config.scheduler.params))
