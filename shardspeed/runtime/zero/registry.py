"""Which strategy class implements which ZeRO stage: the one place a stage number is looked up."""

from __future__ import annotations

from typing import Any

from torch import nn

from shardspeed.runtime.zero.offload import OptimizerOffload, ParamOffload
from shardspeed.runtime.zero.partitioned import (
    GradientPartitionStrategy,
    OptimizerStateStrategy,
)
from shardspeed.runtime.zero.replicated import ReplicatedStrategy
from shardspeed.runtime.zero.sharded import ParamPartitionStrategy
from shardspeed.runtime.zero.strategy import StrategyContext, ZeroStrategy

STRATEGIES: dict[int, type[ZeroStrategy]] = {
    cls.stage: cls
    for cls in (
        ReplicatedStrategy,
        OptimizerStateStrategy,
        GradientPartitionStrategy,
        ParamPartitionStrategy,
    )
}

# zero_optimization keys whose feature is not built yet: a clear error beats silently ignoring
_NOT_YET_SUPPORTED = (
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
)


def strategy_class(stage: int) -> type[ZeroStrategy]:
    """The strategy for ``zero_optimization.stage``; a clear error for stages not built yet."""
    try:
        return STRATEGIES[int(stage)]
    except KeyError:
        built = ", ".join(str(s) for s in sorted(STRATEGIES))
        raise NotImplementedError(
            f"zero_optimization.stage={int(stage)} is not implemented in shardspeed yet "
            f'(available stages: {built}); set "zero_optimization": {{"stage": 0}} for now'
        ) from None


def check_zero_config(zero: Any) -> None:
    """Refuse ``zero_optimization`` settings whose feature shardspeed does not have yet."""
    for key in _NOT_YET_SUPPORTED:
        if getattr(zero, key, False):
            raise NotImplementedError(
                f"zero_optimization.{key}=true (ZeRO++ quantization) is not yet supported in "
                f"shardspeed; remove the key or set it to false"
            )
    if int(getattr(zero, "zero_hpz_partition_size", 1)) > 1:
        raise NotImplementedError(
            "zero_optimization.zero_hpz_partition_size > 1 (ZeRO++ hierarchical partitioning) "
            "is not yet supported in shardspeed; remove the key or set it to 1"
        )
    if int(getattr(zero, "mics_shard_size", -1)) > 0 and int(zero.stage) != 3:
        raise ValueError(
            f"zero_optimization.mics_shard_size (MiCS) shards parameters, which needs ZeRO stage "
            f"3 (got stage {int(zero.stage)}); set stage 3 or remove mics_shard_size"
        )
    ParamOffload.from_config(zero).check(int(zero.stage))
    OptimizerOffload.from_config(zero).check(int(zero.stage))


def build_strategy(module: nn.Module, ctx: StrategyContext) -> ZeroStrategy:
    """Validate ``ctx.zero_config`` and build the strategy for its stage (with no optimizer:
    :meth:`~ZeroStrategy.bind_optimizer` adds one)."""
    check_zero_config(ctx.zero_config)
    return strategy_class(ctx.zero_config.stage)(module, ctx)
