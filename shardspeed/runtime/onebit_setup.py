"""Where the 1-bit optimizers can run, checked once at ``initialize``: ZeRO stage 0 on a plain
data-parallel job (every trained parameter averaged over one group, nothing offloaded), as in
DeepSpeed. They then average over the engine's data-parallel group."""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.comm.parallel_topology import ParallelTopology
from shardspeed.runtime.fp16.onebit.base import OnebitConfigError, OnebitOptimizer
from shardspeed.runtime.zero.strategy import ZeroStrategy


def check_onebit_optimizer(
    optimizer: torch.optim.Optimizer, strategy: ZeroStrategy, topology: ParallelTopology
) -> None:
    """Refuse a combination a 1-bit optimizer cannot run in (ValueError naming the fix), before
    the strategy takes the optimizer. Does nothing for other optimizers."""
    if not isinstance(optimizer, OnebitOptimizer):
        return
    name = type(optimizer).__name__
    if not strategy.supports_local_gradients:
        raise OnebitConfigError(
            f"{name} runs at ZeRO stage 0 only (its compressed momentum exchange replaces the "
            f"gradient all-reduce, which ZeRO stage {strategy.stage} partitions); set "
            '"zero_optimization": {"stage": 0} or use the optimizer type "Adam"/"Lamb"'
        )
    if strategy.offload.enabled:
        raise OnebitConfigError(
            f"{name} steps on the device; remove zero_optimization.offload_optimizer"
        )
    for axis, what in (("pp", "pipeline stages"), ("tp", "AutoTP"), ("sp", "sequence parallel")):
        if topology.size(axis) > 1:
            raise OnebitConfigError(
                f"{name} with {what} ({axis} size {topology.size(axis)}) is not supported: the "
                "1-bit exchange averages whole parameters over one data-parallel group; train "
                f"without {what} or use the optimizer type Adam"
            )


def bind_onebit_optimizer(optimizer: torch.optim.Optimizer, strategy: ZeroStrategy) -> None:
    """Make a 1-bit optimizer average over the one group the strategy reduces over (refused
    when there are several: Mixture of Experts). Does nothing for other optimizers."""
    if not isinstance(optimizer, OnebitOptimizer):
        return
    name = type(optimizer).__name__
    if len(strategy.groups) != 1:
        raise OnebitConfigError(
            f"{name} averages every parameter over one group, and this model's parameters "
            f"reduce over {len(strategy.groups)} (Mixture-of-Experts); use Adam for MoE models"
        )
    optimizer.bind_comm_group(strategy.groups[0].comm.group)


def is_onebit(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of the 1-bit optimizers."""
    return isinstance(optimizer, OnebitOptimizer)


def restore_onebit_params(engine: Any) -> None:
    """After a checkpoint load: put back the rank-local parameters a 1-bit optimizer's state
    carried (0/1 Adam saved between synchronisations) over the rank-0 weights loaded into the
    module and the masters, and cast them into the module. Does nothing for other optimizers."""
    optimizer = getattr(engine.optimizer, "optimizer", None)
    if not isinstance(optimizer, OnebitOptimizer) or not optimizer.restore_local_params():
        return
    for group in engine.strategy.groups:
        group.masters.copy_master_to_model()  # a no-op when the masters are the parameters
