"""The batch triangle, exactly as DeepSpeed 0.19.2 derives and checks it."""

from __future__ import annotations

import pytest

from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError, solve_batch_triangle


@pytest.mark.parametrize(
    ("given", "ws", "expected"),
    [
        ((32, 4, None), 1, (32, 4, 8)),  # train + micro -> gas
        ((32, None, 2), 1, (32, 16, 2)),  # train + gas -> micro
        ((None, 4, 2), 1, (8, 4, 2)),  # micro + gas -> train
        ((32, None, None), 1, (32, 32, 1)),  # train only
        ((None, 4, None), 1, (4, 4, 1)),  # micro only
        ((32, 4, 8), 1, (32, 4, 8)),  # all three, consistent
        ((32, 4, None), 2, (32, 4, 4)),
        ((32, None, 2), 4, (32, 4, 2)),
        ((None, 4, 2), 4, (32, 4, 2)),
        ((32, None, None), 4, (32, 8, 1)),
        ((None, 4, None), 2, (8, 4, 1)),
        ((64, 4, 4), 4, (64, 4, 4)),
    ],
)
def test_derivation(
    given: tuple[int | None, int | None, int | None], ws: int, expected: tuple[int, int, int]
) -> None:
    assert solve_batch_triangle(*given, ws) == expected


def test_inconsistent_triple_names_all_numbers_and_world_size() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        solve_batch_triangle(32, 4, 2, 2)
    msg = str(info.value)
    for text in ("train_batch_size (32)", "(4)", "(2)", "world size (2)", "= 16", "Fix"):
        assert text in msg


def test_floor_division_non_divisible_is_an_error() -> None:
    # DeepSpeed: gas = 10 // 3 // 1 = 3, and 3 * 3 * 1 = 9 != 10
    with pytest.raises(DeepSpeedConfigError) as info:
        solve_batch_triangle(10, 3, None, 1)
    msg = str(info.value)
    assert "(10)" in msg and "(3)" in msg and "world size (1)" in msg
    assert "10 // 3 // 1 = 3" in msg


def test_train_smaller_than_world_derives_zero_micro_batch() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"world size \(4\)"):
        solve_batch_triangle(2, None, None, 4)


@pytest.mark.parametrize("gas", [None, 4])
def test_neither_train_nor_micro_given(gas: int | None) -> None:
    with pytest.raises(DeepSpeedConfigError, match="Either train_batch_size or train_micro"):
        solve_batch_triangle(None, None, gas, 1)


@pytest.mark.parametrize("bad", [(0, 1, 1), (8, 0, None), (8, 2, 0), (-8, -2, 4)])
def test_non_positive_values(bad: tuple[int, int | None, int | None]) -> None:
    with pytest.raises(DeepSpeedConfigError, match="must be > 0"):
        solve_batch_triangle(*bad, 1)


@pytest.mark.parametrize("ws", [0, -1])
def test_bad_world_size(ws: int) -> None:
    with pytest.raises(DeepSpeedConfigError, match="world size"):
        solve_batch_triangle(8, None, None, ws)


def test_config_solves_with_explicit_world_size() -> None:
    cfg = DeepSpeedConfig(
        {"train_batch_size": 64, "gradient_accumulation_steps": 2}, dp_world_size=4
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (64, 8)
    assert cfg.gradient_accumulation_steps == 2 and cfg.dp_world_size == 4


def test_config_world_size_from_mpu_env_and_sequence_parallel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Mpu:
        def get_data_parallel_world_size(self) -> int:
            return 2

    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 3}, mpu=Mpu()).train_batch_size == 6
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1}).dp_world_size == 8
    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4})
    assert cfg.dp_world_size == 2 and cfg.train_batch_size == 2
    with pytest.raises(DeepSpeedConfigError, match="not divisible by sequence_parallel_size"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 3})


def test_config_batch_error_mentions_world_size() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"world size \(2\)"):
        DeepSpeedConfig(
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 4,
            },
            dp_world_size=2,
        )


def test_set_batch_sizes_re_solves_at_the_same_world_size() -> None:
    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2}, dp_world_size=2)
    assert cfg.set_batch_sizes(16, None, 2) == (16, 4, 2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (16, 4)
    with pytest.raises(DeepSpeedConfigError, match=r"world size \(2\)"):
        cfg.set_batch_sizes(10, 4, 2)
    assert cfg.gradient_accumulation_steps == 2  # unchanged after the error
