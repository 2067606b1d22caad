"""DeepSpeed's optimizer-wrapper class names, for the ``isinstance`` checks third-party code makes.

DeepSpeed wraps the optimizer in a different class per mode; shardspeed has one wrapper,
:class:`~shardspeed.runtime.zero.optimizer.ZeroOptimizer`, for every mode. These names answer
``isinstance(engine.optimizer, X)`` as DeepSpeed's engine would have chosen X for the same
config: without ZeRO (stage 0), bf16 gives ``BF16_Optimizer``; fp16 gives ``FP16_Optimizer``
over a ``FusedAdam`` and ``FP16_UnfusedOptimizer`` over any other optimizer; ZeRO stages 1-2 give
``DeepSpeedZeroOptimizer`` and stage 3 ``DeepSpeedZeroOptimizer_Stage3`` (whatever the precision).
They are not built directly: ``shardspeed.initialize`` builds the wrapper.
"""

from __future__ import annotations

from abc import ABCMeta
from typing import Any

from shardspeed.ops.adam.fused_adam import FusedAdam


class _WrapperKind(ABCMeta):
    """A class whose instances are the ZeroOptimizers in one DeepSpeed wrapper mode."""

    def __instancecheck__(cls, instance: Any) -> bool:
        from shardspeed.runtime.zero.optimizer import ZeroOptimizer

        stages = cls.__dict__.get("_stages", (0,))
        if not isinstance(instance, ZeroOptimizer) or int(instance.strategy.stage) not in stages:
            return False
        matches = cls.__dict__.get("_matches")
        return bool(matches is not None and matches(instance))

    def __subclasscheck__(cls, subclass: type) -> bool:
        return type.__subclasscheck__(cls, subclass)


class _DeepSpeedWrapperName(metaclass=_WrapperKind):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            f"{type(self).__name__} is DeepSpeed's name for an optimizer wrapper, kept for "
            "isinstance checks; shardspeed.initialize builds the wrapper from the config "
            "(engine.optimizer)"
        )


def _precision(optimizer: Any) -> Any:
    return optimizer.strategy.ctx.precision


class BF16_Optimizer(_DeepSpeedWrapperName):  # noqa: N801 - DeepSpeed's class name
    """bf16 training without ZeRO."""

    @staticmethod
    def _matches(optimizer: Any) -> bool:
        return bool(_precision(optimizer).bf16_enabled)


class FP16_Optimizer(_DeepSpeedWrapperName):  # noqa: N801 - DeepSpeed's class name
    """fp16 training without ZeRO over a fused optimizer (``FusedAdam``)."""

    @staticmethod
    def _matches(optimizer: Any) -> bool:
        return bool(_precision(optimizer).fp16_enabled) and isinstance(
            optimizer.optimizer, FusedAdam
        )


class FP16_UnfusedOptimizer(_DeepSpeedWrapperName):  # noqa: N801 - DeepSpeed's class name
    """fp16 training without ZeRO over any other optimizer (LAMB, torch's optimizers)."""

    @staticmethod
    def _matches(optimizer: Any) -> bool:
        return bool(_precision(optimizer).fp16_enabled) and not isinstance(
            optimizer.optimizer, FusedAdam
        )


def _any(optimizer: Any) -> bool:
    del optimizer
    return True


class DeepSpeedZeroOptimizer(_DeepSpeedWrapperName):
    """ZeRO stages 1 and 2 (``deepspeed.runtime.zero.stage_1_and_2``)."""

    _stages = (1, 2)
    _matches = staticmethod(_any)


class DeepSpeedZeroOptimizer_Stage3(_DeepSpeedWrapperName):  # noqa: N801 - DeepSpeed's class name
    """ZeRO stage 3 (``deepspeed.runtime.zero.stage3``)."""

    _stages = (3,)
    _matches = staticmethod(_any)
