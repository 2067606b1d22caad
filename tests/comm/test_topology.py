"""Topology: grid arithmetic without processes, and its process groups on live ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.comm import Topology


def test_grid_arithmetic_last_axis_fastest():
    topo = Topology({"pipe": 2, "data": 2, "tensor": 2}, rank=5, world_size=8)
    assert topo.get_coord(5) == {"pipe": 1, "data": 0, "tensor": 1}
    assert topo.rank_of(pipe=1, data=0, tensor=1) == 5
    assert topo.get_axis_groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_ranks("data") == [5, 7] and topo.get_rank("data") == 0
    assert topo.get_ranks("pipe") == [1, 5] and topo.get_rank("pipe") == 1
    assert topo.get_world_size("tensor") == 2 and topo.axis_names == ["pipe", "data", "tensor"]
    with pytest.raises(RuntimeError, match="no process groups"):
        topo.get_group("data")


def test_validation_errors():
    with pytest.raises(ValueError, match="multiply to 6"):
        Topology({"pipe": 2, "data": 3}, rank=0, world_size=4)
    with pytest.raises(ValueError, match="positive integer"):
        Topology({"data": 0}, rank=0, world_size=1)
    with pytest.raises(ValueError, match="did you mean 'data'"):
        Topology({"data": 4}, rank=0, world_size=4).get_rank("dta")
    with pytest.raises(ValueError, match="missing"):
        Topology({"pipe": 2, "data": 2}, rank=0, world_size=4).rank_of(pipe=1)


def test_without_process_group_defaults_to_one_rank():
    if comm.is_initialized():
        pytest.skip("this test process already has a process group")
    topo = Topology()
    assert (
        topo.axes == {"data": 1}
        and topo.get_group("data") is None
        and topo.get_ranks("data") == [0]
    )


def _groups_on_four_ranks() -> dict:
    rank = dist.get_rank()
    topo = Topology({"pipe": 2, "data": 2})
    whole = Topology()  # {"data": 4}: the world group
    flat = Topology({"pipe": 1, "data": 4})
    data_sum = torch.tensor([float(rank)])
    comm.all_reduce(data_sum, group=topo.get_group("data"))
    pipe_sum = torch.tensor([float(rank)])
    comm.all_reduce(pipe_sum, group=topo.get_group("pipe"))
    single = torch.tensor([float(rank)])
    comm.all_reduce(single, group=flat.get_group("pipe"))
    return {
        "data_ranks": topo.get_ranks("data"),
        "data_rank": topo.get_rank("data"),
        "data_size": comm.get_world_size(topo.get_group("data")),
        "data_group_ranks": comm.get_all_ranks_from_group(topo.get_group("data")),
        "data_sum": data_sum.item(),
        "pipe_sum": pipe_sum.item(),
        "single": single.item(),
        "whole_is_world": whole.get_group("data") is None and flat.get_group("data") is None,
    }


def test_groups_on_four_ranks(dist_pool):
    results = dist_pool(4).run(_groups_on_four_ranks)
    for rank, r in enumerate(results):
        pipe, data = divmod(rank, 2)
        assert r["data_ranks"] == r["data_group_ranks"] == [2 * pipe, 2 * pipe + 1]
        assert r["data_rank"] == data and r["data_size"] == 2
        assert r["data_sum"] == float(4 * pipe + 1)
        assert r["pipe_sum"] == float(2 * data + 2)
        assert r["single"] == float(rank)
        assert r["whole_is_world"]
