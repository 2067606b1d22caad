"""``ProcessTopology`` reproduces DeepSpeed's documented examples (spec §16)."""

from __future__ import annotations

import pytest

from shardspeed.runtime.pipe import ProcessTopology
from shardspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
)


def test_documented_examples():
    grid = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert grid.get_rank(x=0, y=1) == 1
    assert grid.get_axis_list("x", 0) == [0, 1, 2]
    assert grid.get_axis_list("y", 0) == [0, 3]
    assert grid.get_coord(4) == grid.ProcessCoord(x=1, y=1)
    assert grid.get_axis_names() == ["x", "y"] and grid.world_size() == 6
    assert ProcessTopology(["a", "b"], [2, 2]).get_rank_repr(3) == "a_01-b_01"
    three = ProcessTopology(["pipe", "data", "model"], [2, 2, 2])
    assert three.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert three.filter_match(pipe=0, data=1) == [2, 3]
    assert three.get_rank_repr(5) == "model_01"  # data and pipe omitted by default
    assert three.get_rank_repr(5, omit_axes=[]) == "pipe_01-data_00-model_01"


def test_named_topologies_and_missing_axes():
    pipe_data = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert pipe_data.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    full = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert full.get_dim("model") == 2 and full.get_dim("sequence") == 0
    assert full.get_axis_comm_lists("sequence") == []
    assert full.mapping[full.get_coord(6)] == 6
    with pytest.raises(ValueError, match="unknown axis 'dta'; did you mean 'data'"):
        full.filter_match(dta=0)
    with pytest.raises(ValueError, match="2 axes"):
        ProcessTopology(["a", "b"], [2])
