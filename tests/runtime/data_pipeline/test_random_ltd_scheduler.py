"""RandomLTDScheduler: fixed_linear from min_value to max_value in seq_per_step increments, the
consumed layer-token count, the state dict (cases from DeepSpeed's test_data_efficiency.py)."""

from __future__ import annotations

import math

import pytest

from shardspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler


def _scheduler(low: int = 16, high: int = 64, steps: int = 10, inc: int = 8) -> RandomLTDScheduler:
    return RandomLTDScheduler(
        {
            "total_layer_num": 4,
            "random_ltd_layer_num": 2,
            "global_batch_size": 2,
            "layer_token_lr_schedule": {"enabled": False},
            "random_ltd_schedule": {
                "min_value": low,
                "max_value": high,
                "schedule_type": "fixed_linear",
                "schedule_config": {"require_steps": steps, "seq_per_step": inc},
            },
        }
    )


def _expected(step: int, low: int, high: int, steps: int, inc: int) -> int:
    value = math.floor(step / steps * (high - low) + low)
    value -= value % inc
    return min(max(value, -(-low // inc) * inc), high)


def test_kept_length_follows_the_formula_and_counts_tokens() -> None:
    sched = _scheduler()
    seen, consumed = [], 0
    for step in range(13):
        sched.update_seq(step)
        seen.append(sched.get_current_seq())
        consumed += 2 * (seen[-1] * 2 + 64 * 2)
        assert sched.state_dict()["consumed_layer_tokens"] == consumed
    assert seen == [_expected(t, 16, 64, 10, 8) for t in range(13)]
    assert seen[:4] == [16, 16, 24, 24] and seen[-1] == 64
    sched.update_seq(12)  # the same step again: no second count
    assert sched.state_dict()["consumed_layer_tokens"] == consumed


@pytest.mark.parametrize(("low", "inc", "first"), [(8, 16, 16), (10, 8, 16), (16, 8, 16)])
def test_respects_the_minimum(low: int, inc: int, first: int) -> None:
    sched = _scheduler(low, 64, 100, inc)
    sched.update_seq(0)
    assert sched.get_current_seq() == first
    values = []
    for step in range(101):
        sched.update_seq(step)
        values.append(sched.get_current_seq())
    assert min(values) >= low and all(v % inc == 0 for v in values) and values[-1] == 64


def test_state_round_trips() -> None:
    sched = _scheduler()
    for step in range(5):
        sched.update_seq(step)
    fresh = _scheduler()
    fresh.load_state_dict(sched.state_dict())
    assert fresh.state_dict() == sched.state_dict()
    sched.update_seq(5)
    fresh.update_seq(5)
    assert fresh.state_dict() == sched.state_dict()


def test_layer_token_lr_schedule_is_refused() -> None:
    config = {
        "total_layer_num": 2,
        "random_ltd_layer_num": 1,
        "global_batch_size": 1,
        "layer_token_lr_schedule": {"enabled": True},
        "random_ltd_schedule": {
            "min_value": 8,
            "max_value": 16,
            "schedule_config": {"require_steps": 2, "seq_per_step": 8},
        },
    }
    with pytest.raises(NotImplementedError, match="layer_token_lr_schedule"):
        RandomLTDScheduler(config)
