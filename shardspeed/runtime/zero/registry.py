"""Which strategy class implements which ZeRO stage: the one place a stage number is looked up."""

from __future__ import annotations

from torch import nn

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


def build_strategy(module: nn.Module, ctx: StrategyContext) -> ZeroStrategy:
    """The strategy for ``ctx.options.stage`` (with no optimizer:
    :meth:`~ZeroStrategy.bind_optimizer` adds one). What the stage cannot do was refused
    before, by :func:`~shardspeed.runtime.zero.rules.check_zero_config`."""
    return strategy_class(ctx.options.stage)(module, ctx)
