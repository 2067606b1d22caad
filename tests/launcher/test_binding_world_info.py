"""Core lists for --bind_cores_to_rank and the --world_info token."""

from __future__ import annotations

import pytest

from shardspeed.launcher.binding import parse_core_list, split_cores
from shardspeed.launcher.world_info import decode_world_info, encode_world_info


def test_core_list() -> None:
    assert parse_core_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_core_list("5") == [5]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0-x", "--bind_core_list '0-x': '0-x' is not a core id or range"),
        ("a", "--bind_core_list 'a': 'a' is not a core id or range"),
        ("3-1", "--bind_core_list '3-1': range '3-1' runs backwards"),
        ("0-2,1", "--bind_core_list '0-2,1' lists core 1 twice"),
        ("", "--bind_core_list '': '' is not a core id or range"),
    ],
)
def test_core_list_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_core_list(spec)
    assert str(info.value) == f"{message}; write core ids and ranges like '0-3,8,10-11'"


def test_split_cores() -> None:
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert split_cores([4, 5], 2) == [[4], [5]]
    with pytest.raises(ValueError, match="1 core\\(s\\) for 2 local ranks"):
        split_cores([0], 2)


def test_world_info_round_trip() -> None:
    world = {"worker-0": [0, 1], "10.0.0.2": [1, 3]}
    token = encode_world_info(world)
    assert token.replace("-", "").replace("_", "").replace("=", "").isalnum()
    assert decode_world_info(token) == world
    assert list(decode_world_info(token)) == ["worker-0", "10.0.0.2"]


@pytest.mark.parametrize("token", ["!!!", encode_world_info({}), "W10="])
def test_world_info_errors(token: str) -> None:
    with pytest.raises(ValueError):
        decode_world_info(token)
