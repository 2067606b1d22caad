"""``utils.groups``: the parallel-axis queries Transformers and Accelerate make."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import shardspeed.utils
from shardspeed.utils import groups


@pytest.fixture(autouse=True)
def no_mpu() -> Iterator[None]:
    yield
    groups.initialize(mpu=None)


def _world_answers() -> tuple:
    from shardspeed import comm

    return (
        groups._get_data_parallel_world_size() == comm.get_world_size(),
        groups._get_data_parallel_rank() == comm.get_rank(),
        groups._get_data_parallel_group() is comm.get_world_group(),
        groups._get_sequence_parallel_world_size(),
        groups._get_sequence_parallel_rank(),
        groups._get_sequence_data_parallel_world_size() == comm.get_world_size(),
        groups._get_model_parallel_world_size(),
        groups._get_broadcast_src_rank(),
    )


def test_without_mpu_every_rank_is_data_parallel(dist_pool) -> None:
    assert dist_pool(2).run(_world_answers) == [(True, True, True, 1, 0, True, 1, 0)] * 2


# an mpu's answers (its groups adopted by the topology): tests/comm/test_parallel_topology.py


def test_missing_axes_and_expert_parallel_say_so() -> None:
    with pytest.raises(RuntimeError, match="no sequence-parallel group"):
        groups._get_sequence_parallel_group()
    if shardspeed.comm.is_initialized():  # an earlier test in this process made a world of 1
        with pytest.raises(ValueError, match="ep_size=2 must divide the data-parallel size"):
            groups.initialize(ep_size=2)
    else:
        with pytest.raises(RuntimeError, match="needs a process group"):
            groups.initialize(ep_size=2)
    assert groups._get_expert_parallel_world_size("ep_size_1") == 1


def test_utils_exposes_groups_lazily() -> None:
    assert shardspeed.utils.groups is groups
    assert shardspeed.utils.numa.parse_range_list("1-2") == [1, 2]
