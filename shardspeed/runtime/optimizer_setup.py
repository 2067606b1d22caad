"""Choosing the basic optimizer and LR scheduler: a client object or callable wins over the config,
as in DeepSpeed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad
from shardspeed.ops.adam import DeepSpeedCPUAdam
from shardspeed.ops.factory import build_optimizer
from shardspeed.ops.lion import DeepSpeedCPULion
from shardspeed.runtime.lr_schedules import scheduler_from_config
from shardspeed.runtime.zero.utils import ZeRORuntimeException
from shardspeed.utils.logging import log_dist

#: the optimizers written to step in host memory (ZeRO-Offload)
_CPU_KINDS = (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)


def build_basic_optimizer(
    client_optimizer: Any,
    model_parameters: Iterable[Any],
    config: Any,
    *,
    cpu_offload: bool = False,
) -> torch.optim.Optimizer | None:
    """The torch optimizer the ZeRO strategy will drive (None for an inference-only engine).
    Under ZeRO-Offload (``cpu_offload``: the strategy offloads its optimizer) the config's Adam,
    Adagrad and Lion are the CPU versions, and a client optimizer must be one of those unless
    ``zero_force_ds_cpu_optimizer`` is false."""
    if client_optimizer is not None:
        if config.optimizer is not None:
            log_dist(
                "client optimizer given to initialize(); ignoring the config's 'optimizer'", [0]
            )
        if isinstance(client_optimizer, torch.optim.Optimizer):
            built = client_optimizer
        elif callable(client_optimizer):
            built = client_optimizer(model_parameters)
        else:
            raise TypeError(
                "initialize(optimizer=...) must be a torch.optim.Optimizer or a callable that "
                f"takes the model parameters and returns one; got {type(client_optimizer).__name__}"
            )
        if cpu_offload and config.zero_force_ds_cpu_optimizer and not isinstance(built, _CPU_KINDS):
            raise ZeRORuntimeException(
                f"ZeRO-Offload steps the optimizer in host memory, and the client optimizer "
                f"{type(built).__name__} is not one written for that (it would be slow): pass "
                "shardspeed.ops.adam.DeepSpeedCPUAdam (or DeepSpeedCPUAdagrad, DeepSpeedCPULion), "
                "name the optimizer in the config's 'optimizer' section, or set "
                '"zero_force_ds_cpu_optimizer": false to use it anyway'
            )
        return built
    if config.optimizer is None:
        return None
    return build_optimizer(
        config.optimizer.type,
        model_parameters,
        dict(config.optimizer.params),
        cpu_offload=cpu_offload,
    )


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
