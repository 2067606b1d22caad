"""CurriculumScheduler: the four schedule types against their formulas, DeepSpeed's floor and
clamp cases (``tests/unit/runtime/test_data_efficiency.py``), the state dict, the errors."""

from __future__ import annotations

import math
from typing import Any

import pytest

from shardspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler


def _scheduler(kind: str, low: int = 8, high: int = 64, **sched: Any) -> CurriculumScheduler:
    return CurriculumScheduler(
        {
            "min_difficulty": low,
            "max_difficulty": high,
            "schedule_type": kind,
            "schedule_config": sched,
        }
    )


def _root(step: int, low: int, high: int, total: int, dstep: int, degree: float) -> int:
    value = math.floor((step / total) ** (1 / degree) * (high - low) + low)
    value -= value % dstep
    return min(max(value, -(-low // dstep) * dstep), high)


def test_fixed_linear_follows_the_formula() -> None:
    sched = _scheduler("fixed_linear", total_curriculum_step=10, difficulty_step=8)
    got = [sched.get_difficulty(t) for t in range(13)]
    assert got == [_root(t, 8, 64, 10, 8, 1) for t in range(13)]
    assert got[:6] == [8, 8, 16, 24, 24, 32] and got[10:] == [64, 64, 64]


def test_fixed_root_follows_the_formula() -> None:
    sched = _scheduler("fixed_root", total_curriculum_step=10, difficulty_step=8, root_degree=2)
    got = [sched.get_difficulty(t) for t in range(12)]
    assert got == [_root(t, 8, 64, 10, 8, 2) for t in range(12)]
    assert got[1] == 24  # sqrt grows fast early: floor(sqrt(0.1) * 56 + 8) = 25 -> 24


def test_fixed_discrete_holds_each_difficulty_to_its_max_step() -> None:
    sched = _scheduler("fixed_discrete", difficulty=[8, 16, 32], max_step=[2, 5])
    assert [sched.get_difficulty(t) for t in range(8)] == [8, 8, 8, 16, 16, 16, 32, 32]


def test_custom_uses_the_given_function() -> None:
    sched = _scheduler("custom")
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        sched.get_difficulty(1)
    sched.set_custom_get_difficulty(lambda step: 8 * (step + 1))
    assert [sched.update_difficulty(t) for t in range(10)] == [
        8,
        16,
        24,
        32,
        40,
        48,
        56,
        64,
        64,
        64,
    ]


@pytest.mark.parametrize("kind", ["fixed_linear", "fixed_root"])
@pytest.mark.parametrize(("low", "dstep"), [(8, 16), (1, 8), (10, 8), (64, 16), (100, 64)])
def test_never_below_min_and_always_a_multiple(kind: str, low: int, dstep: int) -> None:
    extra = {"root_degree": 2} if kind == "fixed_root" else {}
    sched = _scheduler(kind, low, 1024, total_curriculum_step=100, difficulty_step=dstep, **extra)
    values = [sched.get_difficulty(t) for t in range(100)]
    assert min(values) >= low and max(values) <= 1024
    assert all(v % dstep == 0 for v in values)


def test_first_is_the_aligned_min_and_last_the_max() -> None:
    assert (
        _scheduler(
            "fixed_linear", 8, 1024, total_curriculum_step=100, difficulty_step=16
        ).get_difficulty(0)
        == 16
    )
    assert (
        _scheduler(
            "fixed_linear", 16, 1000, total_curriculum_step=100, difficulty_step=16
        ).get_difficulty(200)
        == 1000
    )


def test_update_stops_at_max_and_state_round_trips() -> None:
    sched = _scheduler("fixed_linear", total_curriculum_step=4, difficulty_step=8)
    assert sched.get_current_difficulty() == 8
    assert sched.update_difficulty(4) == 64
    # once at the maximum the difficulty no longer follows the step (DeepSpeed's rule)
    assert sched.update_difficulty(0) == 64
    saved = sched.state_dict()
    fresh = _scheduler("fixed_linear", total_curriculum_step=4, difficulty_step=8)
    fresh.load_state_dict(saved)
    assert fresh.get_state() == sched.get_state() and fresh.get_current_difficulty() == 64


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"max_difficulty": 8, "schedule_type": "fixed_linear"}, "min_difficulty"),
        (
            {
                "min_difficulty": 1,
                "max_difficulty": 8,
                "schedule_type": "fixed_root",
                "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 1},
            },
            "root_degree",
        ),
        (
            {
                "min_difficulty": 1,
                "max_difficulty": 8,
                "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [1, 2], "max_step": [1, 2]},
            },
            "difficulty",
        ),
    ],
)
def test_missing_keys_raise_an_assertion_and_value_error(config: dict[str, Any], key: str) -> None:
    with pytest.raises(AssertionError, match=key):
        CurriculumScheduler(config)
    with pytest.raises(ValueError, match=key):
        CurriculumScheduler(config)


def test_unknown_schedule_type() -> None:
    with pytest.raises(ValueError, match="fixed_cubic"):
        _scheduler("fixed_cubic")
