"""``CurriculumScheduler``: the difficulty (sequence length, metric value, percentile) by step.

Four schedules, as DeepSpeed's:

* ``fixed_linear``: ``d(t) = min + (max - min) * t / total_curriculum_step``;
* ``fixed_root``: the same with ``(t / total_curriculum_step) ** (1 / root_degree)``;

  both floored to an integer, then down to a multiple of ``difficulty_step``, then clamped to
  ``[the first multiple of difficulty_step at or above min, max]``;
* ``fixed_discrete``: ``difficulty[i]`` for steps up to ``max_step[i]``, the last difficulty
  after;
* ``custom``: a function of the step given with :meth:`set_custom_get_difficulty`.

The difficulty only moves while it is below ``max_difficulty`` (:meth:`update_difficulty`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from shardspeed.utils.logging import logger

__all__ = ["CurriculumScheduler"]

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")


class CurriculumScheduler:
    """The difficulty schedule of one curriculum (``config`` is DeepSpeed's dict: the
    ``min_difficulty``, ``max_difficulty``, ``schedule_type`` and ``schedule_config`` keys)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if key not in config:
                raise _ConfigAssertion(f"Curriculum learning requires the config '{key}'")
        kind = config["schedule_type"]
        if kind not in SCHEDULE_TYPES:
            raise ValueError(
                f"Unsupported curriculum schedule_type {kind!r}; use one of {list(SCHEDULE_TYPES)}"
            )
        sched = dict(config.get("schedule_config") or {})
        _check_schedule_config(kind, sched)
        #: DeepSpeed's state dict: what a checkpoint saves
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": kind,
        }
        if kind != "custom":
            self.state["schedule_config"] = sched
        self.first_step = True
        self.custom_get_difficulty: Callable[[int], int] | None = None

    # -- DeepSpeed's accessors ------------------------------------------------------------------
    def get_current_difficulty(self) -> Any:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: Any) -> None:
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        """The ``custom`` schedule: ``schedule_function(global_step) -> difficulty``."""
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.state = dict(state)

    # the names checkpoints use elsewhere in the package
    def state_dict(self) -> dict[str, Any]:
        """A copy of the state (schedule, bounds, current difficulty)."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.state.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.set_state(state)

    # -- the schedule ---------------------------------------------------------------------------
    def get_difficulty(self, global_steps: int) -> Any:
        """The schedule's difficulty at ``global_steps`` (no state change)."""
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1.0)
        if kind == "fixed_root":
            return self._root(global_steps, float(self.state["schedule_config"]["root_degree"]))
        if self.custom_get_difficulty is None:
            raise RuntimeError(
                "schedule_type 'custom' needs its function: call "
                "set_custom_get_difficulty(fn) (engine.set_custom_curriculum_learning_schedule "
                "for the data sampler) before training"
            )
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        """Move to the difficulty of ``global_steps`` unless already at the maximum; returns it."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    def _discrete(self, global_steps: int) -> Any:
        sched = self.state["schedule_config"]
        for difficulty, last in zip(sched["difficulty"], sched["max_step"], strict=False):
            if global_steps <= last:
                return difficulty
        return sched["difficulty"][-1]

    def _root(self, global_steps: int, degree: float) -> int:
        sched = self.state["schedule_config"]
        low, high = self.state["min_difficulty"], self.state["max_difficulty"]
        step = int(sched["difficulty_step"])
        progress = (float(global_steps) / sched["total_curriculum_step"]) ** (1.0 / degree)
        value = math.floor(progress * (high - low) + low)
        value -= value % step
        # flooring to the step can fall under the start (min 8, step 16 gives 0): the floor is
        # the first multiple of the step at or above min, so both promises hold
        value = max(value, -(-low // step) * step)
        return int(min(value, high))


class _ConfigAssertion(ValueError, AssertionError):
    """A missing curriculum key: DeepSpeed asserts, so this is also an AssertionError."""


def _check_schedule_config(kind: str, sched: Mapping[str, Any]) -> None:
    needed = {
        "fixed_linear": ("total_curriculum_step", "difficulty_step"),
        "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
        "fixed_discrete": ("difficulty", "max_step"),
        "custom": (),
    }[kind]
    for key in needed:
        if key not in sched:
            raise _ConfigAssertion(
                f"Curriculum learning with {kind} schedule requires the schedule_config '{key}'"
            )
    if kind == "fixed_discrete" and (
        not sched["max_step"] or len(sched["difficulty"]) != len(sched["max_step"]) + 1
    ):
        raise _ConfigAssertion(
            "fixed_discrete: schedule_config 'difficulty' needs exactly one more entry than "
            "'max_step' (the last difficulty holds for every later step)"
        )
    if kind in ("fixed_linear", "fixed_root") and sched["difficulty_step"] % 8 != 0:
        logger.warning(
            "curriculum difficulty_step is not a multiple of 8: for the seqlen metric, "
            "multiples of 8 (fp16) or 16 (int8) keep tensor cores in use; ignore this for "
            "other metrics"
        )
