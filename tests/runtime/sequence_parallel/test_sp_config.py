"""Sequence-parallel settings that cannot work are refused at ``initialize`` with the key and
the fix: a size that does not divide the world, ``mesh_param`` disagreeing with the config, a
``data_parallel_size`` that does not fill the world, and what is not built with it."""

from __future__ import annotations

import pytest

import shardspeed
from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.sequence_parallel.rules import (
    check_sequence_parallel,
    sequence_parallel_size,
    with_mesh_param,
)
from tests.runtime.parity import MLP

BASE = {"train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize("size", [2, 3])
def test_size_must_divide_the_world(size: int) -> None:
    with pytest.raises(ValueError, match=f"sequence_parallel_size={size} does not divide"):
        shardspeed.initialize(model=MLP(), config={**BASE, "sequence_parallel_size": size})


def test_size_one_is_plain_data_parallelism() -> None:
    engine, *_ = shardspeed.initialize(model=MLP(), config={**BASE, "sequence_parallel_size": 1})
    assert engine.sequence_parallel_size == 1 and engine.seq_parallel_group is None
    assert engine.seq_dp_world_size == engine.dp_world_size == 1


def test_mesh_param_sets_and_must_agree() -> None:
    source, sp = with_mesh_param(dict(BASE), (2, 4))
    assert sp == 4 and source["data_parallel_size"] == 2
    with pytest.raises(ValueError, match="sets sequence_parallel_size=4 but the config has"):
        with_mesh_param({**BASE, "sequence_parallel_size": 2}, (2, 4))
    with pytest.raises(ValueError, match="mesh_param must be a"):
        with_mesh_param(dict(BASE), (2, "4"))
    with pytest.raises(
        ValueError, match="sequence_parallel_size=2 does not divide the world size 1"
    ):
        shardspeed.initialize(model=MLP(), config=dict(BASE), mesh_param=(1, 2))


def test_mesh_param_of_one_rank_trains() -> None:
    engine, *_ = shardspeed.initialize(model=MLP(), config=dict(BASE), mesh_param=(1, 1))
    assert engine.sequence_parallel_size == 1


def _config(**extra: object) -> DeepSpeedConfig:
    return DeepSpeedConfig({**BASE, **extra}, dp_world_size=1)


def test_data_parallel_size_must_fill_the_world() -> None:
    config = _config(sequence_parallel_size=2, data_parallel_size=1)
    with pytest.raises(ValueError, match="set data_parallel_size to 2"):
        check_sequence_parallel(config, None, world_size=4)
    check_sequence_parallel(_config(sequence_parallel_size=2, data_parallel_size=2), None, 4)
    with pytest.raises(ValueError, match="set data_parallel_size to 1"):
        check_sequence_parallel(_config(sequence_parallel_size=2, data_parallel_size=2), None, 2)


class _Mpu:
    def __init__(self, sp: int) -> None:
        self.sp = sp

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp


def test_config_and_mpu_must_agree() -> None:
    assert sequence_parallel_size(_config(), _Mpu(4)) == 4
    assert sequence_parallel_size(_config(sequence_parallel_size=4), _Mpu(4)) == 4
    with pytest.raises(ValueError, match="mpu's sequence-parallel group has 2 ranks"):
        sequence_parallel_size(_config(sequence_parallel_size=4), _Mpu(2))


@pytest.mark.parametrize(
    "extra, refused",
    [
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, "MiCS"),
        ({"expert_parallel": {"enabled": True}}, "AutoEP"),
        ({"tensor_parallel": {"autotp_size": 2}}, "autotp_size=2"),
    ],
)
def test_unbuilt_combinations_are_refused(extra: dict, refused: str) -> None:
    with pytest.raises(NotImplementedError, match=refused):
        check_sequence_parallel(_config(sequence_parallel_size=2, **extra), None, world_size=2)


def test_data_parallel_size_alone_must_fill_the_world() -> None:
    with pytest.raises(ValueError, match="data_parallel_size=2 x sequence_parallel_size=1"):
        shardspeed.initialize(model=MLP(), config=dict(BASE), mesh_param=(2, 1))
