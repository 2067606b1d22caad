"""Which strategy class implements which ZeRO stage: the one place a stage number is looked up."""

from __future__ import annotations

from shardspeed.runtime.zero.stage0 import ReplicatedStrategy
from shardspeed.runtime.zero.strategy import ZeroStrategy

STRATEGIES: dict[int, type[ZeroStrategy]] = {
    ReplicatedStrategy.stage: ReplicatedStrategy,
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
