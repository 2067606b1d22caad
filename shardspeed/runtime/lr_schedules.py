"""DeepSpeed's per-batch learning-rate schedules: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR
and WarmupCosineLR, plus :func:`scheduler_from_config` for a config's ``scheduler`` section.

Each schedule is stepped once per training batch. ``last_batch_iteration`` counts batches: -1
starts from the beginning (and writes the initial LR into the optimizer at construction); any
other value resumes there. A schedule takes anything with ``param_groups`` (a torch optimizer or
a :class:`~shardspeed.runtime.base_optimizer.DeepSpeedOptimizer`) and writes ``group["lr"]``.
Formulas follow DeepSpeed's ``deepspeed/runtime/lr_schedules.py`` and are given per class.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

import torch

# DeepSpeed's module-level names of deepspeed.runtime.lr_schedules: schedule names, config keys
from shardspeed.runtime.lr_schedule_args import (
    COS_MIN_RATIO,
    CYCLE_FIRST_STAIR_COUNT,
    CYCLE_FIRST_STEP_SIZE,
    CYCLE_MAX_LR,
    CYCLE_MAX_MOM,
    CYCLE_MIN_LR,
    CYCLE_MIN_MOM,
    CYCLE_MOMENTUM,
    CYCLE_SECOND_STAIR_COUNT,
    CYCLE_SECOND_STEP_SIZE,
    DECAY_LR_RATE,
    DECAY_MOM_RATE,
    DECAY_STEP_SIZE,
    EDGE_VALUE,
    LR_RANGE_TEST,
    LR_RANGE_TEST_MIN_LR,
    LR_RANGE_TEST_STAIRCASE,
    LR_RANGE_TEST_STEP_RATE,
    LR_RANGE_TEST_STEP_SIZE,
    LR_SCHEDULE,
    MID_VALUE,
    ONE_CYCLE,
    TOTAL_NUM_STEPS,
    VALID_LR_SCHEDULES,
    WARMUP_COSINE_LR,
    WARMUP_DECAY_LR,
    WARMUP_LINEAR_RATE,
    WARMUP_LOG_RATE,
    WARMUP_LR,
    WARMUP_MAX_LR,
    WARMUP_MIN_LR,
    WARMUP_MIN_RATIO,
    WARMUP_NUM_STEPS,
    WARMUP_TYPE,
    WARMUP_TYPES,
    add_tuning_arguments,
    get_config_from_args,
    get_lr_from_config,
    parse_arguments,
)
from shardspeed.runtime.lr_schedule_base import (
    BatchSchedule,
    check_scheduler_kwargs,
    per_group,
    set_lrs,
    torch_schedulers,
)
from shardspeed.utils.logging import logger


class LRRangeTest(BatchSchedule):
    """LR range test: raise the LR from ``lr_range_test_min_lr`` at a constant rate.

    With ``i = last_batch_iteration + 1``, ``interval = i / step_size`` (floored when
    ``lr_range_test_staircase``), ``lr = min_lr * (1 + step_rate * interval)``. Used to find the
    largest LR that trains without diverging (https://arxiv.org/abs/1803.09820).

    Args:
        optimizer: the wrapped optimizer.
        lr_range_test_min_lr: the starting LR, one float or a list with one per param group.
        lr_range_test_step_size: training steps per LR increase. (default: 2000)
        lr_range_test_step_rate: scaling rate of the increase. (default: 1.0)
        lr_range_test_staircase: increase in steps rather than continuously. (default: False)
        last_batch_iteration: the index of the last batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size}")
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = set_lrs(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(interval)) if self.staircase else interval

    def get_lr(self) -> list[float]:
        """``min_lr * (1 + step_rate * interval)`` for every param group."""
        increase = 1.0 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to ``batch_iteration`` (default: the next batch) and set the LRs."""
        self._advance(batch_iteration)


class OneCycle(BatchSchedule):
    """1Cycle: one LR cycle up and down (momentum mirrored), then an optional decay.

    With ``i = last_batch_iteration + 1``, ``T = first + second`` step sizes and
    ``x = i / T - floor(i / T)`` the position in the cycle, the scale is ``x / (first / T)``
    while rising and ``(x - 1) / (first / T - 1)`` while falling. A stair count ``n > 0`` holds
    the scale on ``n`` flat stairs per half instead: ``floor(k * n / half) / n`` with ``k`` the
    batch offset from the half's low end. In the cycle (``last_batch_iteration < T``)::

        lr  = cycle_min_lr  + (cycle_max_lr  - cycle_min_lr)  * scale
        mom = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale

    After it, with ``d = last_batch_iteration - T + 1``: ``lr = cycle_min_lr / (1 +
    decay_lr_rate * d / decay_step_size)`` and ``mom = cycle_max_mom * (1 + decay_mom_rate * d /
    decay_step_size)``; ``decay_step_size=0`` or a zero rate holds them at min LR / max momentum.

    Momentum is ``betas[0]`` for Adam-like groups and ``momentum`` for SGD-like groups. Unlike
    DeepSpeed, which overwrites ``betas`` with ``(mom, 0.99)``, a group keeps its own ``beta2``.

    Args:
        optimizer: the wrapped optimizer.
        cycle_min_lr, cycle_max_lr: LR bounds, floats or one per param group.
        decay_lr_rate: post-cycle LR decay rate. (default: 0)
        cycle_first_step_size: batches in the rising half. (default: 2000)
        cycle_second_step_size: batches in the falling half; None = first, 0 = none (the
            LR drops back to ``cycle_min_lr`` after the rise). (default: None)
        cycle_first_stair_count: stairs in the rising half; 0 = continuous. (default: 0)
        cycle_second_stair_count: stairs in the falling half; None = first. (default: None)
        decay_step_size: post-cycle decay interval; 0 = no decay. (default: 0)
        cycle_momentum: cycle momentum inversely to the LR. (default: True)
        cycle_min_mom, cycle_max_mom: momentum bounds, floats or one per group. (0.8, 0.9)
        decay_mom_rate: post-cycle momentum decay rate. (default: 0)
        last_batch_iteration: the index of the last batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        # a second step size of 0 is DeepSpeed's "no falling half": the LR rises over the first
        # half, then the post-cycle phase starts from cycle_min_lr
        if cycle_first_step_size <= 0 or second < 0:
            raise ValueError(
                f"cycle_first_step_size must be > 0 and cycle_second_step_size >= 0, got "
                f"cycle_first_step_size={cycle_first_step_size}, "
                f"cycle_second_step_size={cycle_second_step_size}; pass batch counts"
            )
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self.min_moms = per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")
        self._mom_keys = [self._momentum_key(g) for g in self.optimizer.param_groups]
        self.cycle_momentum = cycle_momentum
        if cycle_momentum and not any(self._mom_keys):
            logger.warning(
                f"cycle_momentum is disabled: optimizer {type(self.optimizer).__name__} has "
                "neither 'betas' nor 'momentum' in its param groups"
            )
            self.cycle_momentum = False
        if last_batch_iteration == -1:
            self._last_lr = set_lrs(self.optimizer.param_groups, self.min_lrs)
            if self.cycle_momentum:
                self._set_moms(self.min_moms)

    @staticmethod
    def _momentum_key(group: dict[str, Any]) -> str | None:
        if "betas" in group:
            return "betas"
        return "momentum" if "momentum" in group else None

    def _scale(self) -> float:
        i = self.last_batch_iteration + 1
        x = i / self.total_size - math.floor(i / self.total_size)
        rising = x <= self.step_ratio
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs and stairs > 0:
            # from the integer offset: the float scale at a half's end can sit 1e-16 under a
            # stair boundary, and flooring it would drop a whole stair
            k = i % self.total_size
            half = self.first_step_size if rising else self.second_step_size
            offset = k if rising else self.total_size - k
            return math.floor(offset * stairs / half) / stairs
        return x / self.step_ratio if rising else (x - 1.0) / (self.step_ratio - 1.0)

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        """The LR of every param group at ``last_batch_iteration`` (see the class docstring)."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """The momentum (``betas[0]`` / ``momentum``) of every param group, or None if off."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval()
        return [hi * factor for hi in self.max_moms]

    def _set_moms(self, moms: Sequence[float]) -> None:
        for group, key, mom in zip(self.optimizer.param_groups, self._mom_keys, moms, strict=True):
            if key == "betas":
                group["betas"] = (mom, group["betas"][1])
            elif key == "momentum":
                group["momentum"] = mom

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to ``batch_iteration`` (default: the next batch); set LRs and momenta."""
        self._advance(batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._set_moms(moms)


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int):
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {list(WARMUP_TYPES)}, got {warmup_type!r}")


def _warmup_fraction(iteration: int, num_steps: int, warmup_type: str) -> float:
    """Warmup progress in [0, 1): ``log(i + 1) / log(n)`` or ``i / n``."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


class WarmupLR(BatchSchedule):
    """Warm the LR up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    ``lr = min_lr + (max_lr - min_lr) * gamma`` with, for ``i = last_batch_iteration`` and
    ``n = max(2, warmup_num_steps)``: ``gamma = log(i + 1) / log(n)`` ('log') or ``i / n``
    ('linear') while ``i < n``, then 1. Before the first step the LR is ``min_lr``.

    Args:
        optimizer: the wrapped optimizer.
        warmup_min_lr: starting LR, a float or one per param group. (default: 0)
        warmup_max_lr: peak LR, a float or one per group; None takes each group's current LR.
        warmup_num_steps: batches of warmup. (default: 1000)
        warmup_type: 'log' (default) or 'linear'.
        last_batch_iteration: the index of the last batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if last_batch_iteration == -1:
            self._apply()

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
        return 1.0

    def get_lr(self) -> list[float]:
        """``min_lr + (max_lr - min_lr) * gamma`` for every param group."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next batch) and set the LRs."""
        self._advance(last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    """Warm up as :class:`WarmupLR`, then decay linearly to 0 at ``total_num_steps``.

    After warmup (``i >= n``): ``gamma = max(0, (total_num_steps - i) / max(1, total_num_steps -
    n))``, so the LR is ``max_lr`` at ``i = n`` and ``min_lr`` from ``i = total_num_steps`` on.

    Args:
        optimizer: the wrapped optimizer.
        total_num_steps: total training batches.
        warmup_min_lr: starting LR, a float or one per param group. (default: 0)
        warmup_max_lr: peak LR, a float or one per param group. (default: 0.001)
        warmup_num_steps: batches of warmup. (default: 1000)
        warmup_type: 'log' (default) or 'linear'.
        last_batch_iteration: the index of the last batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                f"total_num_steps {total_num_steps} is less than warmup_num_steps "
                f"{warmup_num_steps}"
            )

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._get_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(BatchSchedule):
    """Warm up as a ratio of each group's base LR, then follow a cosine down to a floor ratio.

    The base LR is each group's ``lr`` at construction. While ``i < n`` (``i =
    last_batch_iteration``, ``n = max(2, warmup_num_steps)``)::

        ratio = warmup_min_ratio + (1 - warmup_min_ratio) * f,  f = log(i + 1) / log(n) or i / n

    then, with ``p = min(1, (i - n + 1) / max(1, total_num_steps - n))``::

        ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)

    and ``lr = base_lr * ratio``. Before the first step the LR is 0, as in DeepSpeed.

    Args:
        optimizer: the wrapped optimizer.
        total_num_steps: total training batches.
        warmup_min_ratio: starting ratio, a float or one per param group. (default: 0)
        warmup_num_steps: batches of warmup. (default: 1000)
        cos_min_ratio: final ratio. (default: 0.0001)
        warmup_type: 'log' (default) or 'linear'.
        last_batch_iteration: the index of the last batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float | list[float] = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratios = per_group(self.optimizer, warmup_min_ratio, "warmup_min_ratio")
        self.warmup_num_steps = max(2, warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                f"total_num_steps {total_num_steps} is less than warmup_num_steps "
                f"{warmup_num_steps}"
            )
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        """The ratio of the base LR at ``last_batch_iteration``, a float as in DeepSpeed.

        With one ``warmup_min_ratio`` per param group the warmup ratios differ by group; this
        is then the first group's (:meth:`get_lr` uses each group's own)."""
        return self._ratio(self.warmup_min_ratios[0])

    def _ratio(self, warmup_min_ratio: float) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            f = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return warmup_min_ratio + (1.0 - warmup_min_ratio) * f
        real_total = max(1, self.total_num_steps - self.warmup_num_steps)
        # clamped so the ratio stays at the floor past total_num_steps instead of rising again
        progress = min(1.0, (i - self.warmup_num_steps + 1) / real_total)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """``base_lr * ratio`` for every param group."""
        return [
            lr * self._ratio(low)
            for lr, low in zip(self.org_lrs, self.warmup_min_ratios, strict=True)
        ]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next batch) and set the LRs."""
        self._advance(last_batch_iteration)


_SCHEDULES: dict[str, type[BatchSchedule]] = {
    LR_RANGE_TEST: LRRangeTest,
    ONE_CYCLE: OneCycle,
    WARMUP_LR: WarmupLR,
    WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}


def scheduler_from_config(name: str, optimizer: Any, params: dict[str, Any] | None = None) -> Any:
    """The scheduler for config ``{"type": name, "params": params}`` driving ``optimizer``.

    DeepSpeed's schedules (:data:`VALID_LR_SCHEDULES`) come first, then any class of
    ``torch.optim.lr_scheduler``; both are matched case-insensitively. An unknown name or
    parameter raises ``ValueError`` naming the closest valid one. ``params`` is not modified.
    """
    kwargs = dict(params or {})
    ours = {key.lower(): cls for key, cls in _SCHEDULES.items()}
    cls: type | None = _SCHEDULES.get(name) or ours.get(str(name).lower())
    if cls is None:
        cls = torch_schedulers().get(str(name).lower())
        if cls is not None:
            # torch's schedulers insist on a torch.optim.Optimizer, not a wrapper of one
            if not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = getattr(optimizer, "optimizer", optimizer)
    if cls is None:
        valid = VALID_LR_SCHEDULES + sorted(c.__name__ for c in torch_schedulers().values())
        near = difflib.get_close_matches(str(name).lower(), [v.lower() for v in valid], n=1)
        hint = (
            f" Did you mean {valid[[v.lower() for v in valid].index(near[0])]!r}?" if near else ""
        )
        raise ValueError(
            f"unknown LR scheduler type {name!r}.{hint} Valid types: {', '.join(valid)}"
        )
    check_scheduler_kwargs(cls, kwargs)
    return cls(optimizer, **kwargs)


__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "scheduler_from_config",
    "add_tuning_arguments",
    "get_config_from_args",
    "get_lr_from_config",
    "parse_arguments",
    "LR_SCHEDULE",
    "LR_RANGE_TEST",
    "ONE_CYCLE",
    "WARMUP_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_COSINE_LR",
    "VALID_LR_SCHEDULES",
    "LR_RANGE_TEST_MIN_LR",
    "LR_RANGE_TEST_STEP_RATE",
    "LR_RANGE_TEST_STEP_SIZE",
    "LR_RANGE_TEST_STAIRCASE",
    "EDGE_VALUE",
    "MID_VALUE",
    "CYCLE_FIRST_STEP_SIZE",
    "CYCLE_FIRST_STAIR_COUNT",
    "CYCLE_SECOND_STEP_SIZE",
    "CYCLE_SECOND_STAIR_COUNT",
    "DECAY_STEP_SIZE",
    "CYCLE_MIN_LR",
    "CYCLE_MAX_LR",
    "DECAY_LR_RATE",
    "CYCLE_MOMENTUM",
    "CYCLE_MIN_MOM",
    "CYCLE_MAX_MOM",
    "DECAY_MOM_RATE",
    "WARMUP_MIN_LR",
    "WARMUP_MAX_LR",
    "WARMUP_NUM_STEPS",
    "WARMUP_TYPE",
    "WARMUP_LOG_RATE",
    "WARMUP_LINEAR_RATE",
    "WARMUP_TYPES",
    "WARMUP_MIN_RATIO",
    "COS_MIN_RATIO",
    "TOTAL_NUM_STEPS",
]
