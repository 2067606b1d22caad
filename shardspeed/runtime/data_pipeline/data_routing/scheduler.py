"""``RandomLTDScheduler``: how many tokens random-LTD's layers keep at each step.

``fixed_linear`` (the one schedule DeepSpeed has): the kept length grows from ``min_value``
to ``max_value`` over ``require_steps``, in multiples of ``seq_per_step``:

    k(t) = floor(min + (max - min) * t / require_steps), down to a multiple of seq_per_step,
           clamped to [the first multiple of seq_per_step at or above min, max]

The scheduler also counts the layer-tokens consumed (Random-LTD paper, arXiv 2211.11586): per
step, ``global_batch_size * (k * dropping layers + max_value * other layers)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["RandomLTDScheduler"]

#: the keys :meth:`RandomLTDScheduler.state_dict` saves (DeepSpeed's)
STATE_KEYS = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")


class RandomLTDScheduler:
    """The kept-length schedule (``config`` is DeepSpeed's ``random_ltd`` dict with
    ``global_batch_size`` filled in)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.model_layer_num = int(config["total_layer_num"])
        self.random_ltd_layer_num = int(config["random_ltd_layer_num"])
        self.config_schedule: Mapping[str, Any] = config["random_ltd_schedule"]
        self.global_batch_size = int(config.get("global_batch_size") or 1)
        lr_schedule = config.get("layer_token_lr_schedule") or {}
        if lr_schedule.get("enabled", False):
            raise NotImplementedError(
                "random_ltd.layer_token_lr_schedule.enabled=true: the layer-token learning-rate "
                "schedule is unfinished in DeepSpeed too; set it to false"
            )
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        """Back to step 0: kept length ``min_value``, no tokens consumed."""
        sched = self.config_schedule
        self.state.update(
            min_value=int(sched["min_value"]),
            max_value=int(sched["max_value"]),
            current_value=int(sched["min_value"]),
            schedule_config=dict(sched["schedule_config"]),
            schedule_type=sched.get("schedule_type", "fixed_linear"),
            consumed_layer_tokens=0,
            current_steps=-1,
        )

    # -- DeepSpeed's accessors ------------------------------------------------------------------
    def get_current_seq(self) -> int:
        """Tokens the dropping layers keep now."""
        return int(self.state["current_value"])

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = int(seq_length)

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer-tokens consumed after ``train_iters`` steps from here."""
        for step in range(train_iters):
            self.update_seq(step)
        return int(self.state["consumed_layer_tokens"])

    # -- the schedule ---------------------------------------------------------------------------
    def get_value(self, global_steps: int) -> int:
        """The schedule's kept length at ``global_steps`` (no state change)."""
        if self.state["schedule_type"] != "fixed_linear":
            raise ValueError(
                f"Unsupported random-LTD schedule_type {self.state['schedule_type']!r}; "
                "use 'fixed_linear'"
            )
        sched = self.state["schedule_config"]
        low, high = self.state["min_value"], self.state["max_value"]
        step = int(sched["seq_per_step"])
        value = math.floor(float(global_steps) / sched["require_steps"] * (high - low) + low)
        value -= value % step
        # alignment must not take the kept length under the configured minimum
        value = max(value, -(-low // step) * step)
        return int(min(value, high))

    def update_seq(self, global_steps: int) -> None:
        """Move the kept length to ``global_steps``' value; count the step's layer-tokens once."""
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            kept = self.state["current_value"] * self.random_ltd_layer_num
            full = self.state["max_value"] * (self.model_layer_num - self.random_ltd_layer_num)
            self.state["consumed_layer_tokens"] += self.global_batch_size * (kept + full)
            self.state["current_steps"] = global_steps

    def state_dict(self) -> dict[str, Any]:
        return {key: self.state[key] for key in STATE_KEYS}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for key in STATE_KEYS:
            self.state[key] = state_dict[key]
