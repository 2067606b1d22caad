"""The always-on byte counter and the comms logger: exact sizes, bus factors, summary table."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.comm.logger import CommsLogger, format_size


def _three_ops(numel: int) -> None:
    world = dist.get_world_size()
    comm.all_reduce(torch.ones(numel))
    comm.all_gather_into_tensor(torch.empty(numel), torch.ones(numel // world))
    comm.reduce_scatter_tensor(torch.empty(numel // world), torch.ones(numel))


def _volume_of_three_ops() -> dict:
    comm.reset_comm_volume()
    _three_ops(1000)
    # async ops count too, and still hand back their work handle
    work = comm.all_reduce(torch.ones(1000), async_op=True)
    assert work is not None
    work.wait()
    volume = comm.get_comm_volume()
    comm.reset_comm_volume()
    assert comm.get_comm_volume() == {}
    return volume


def _volume_on_subgroup() -> dict:
    # every rank creates the group; only members communicate and count
    group = comm.new_group([0, 1])
    comm.reset_comm_volume()
    if dist.get_rank() < 2:
        comm.all_reduce(torch.ones(100), group=group)
    comm.all_reduce(torch.ones(10))
    volume = comm.get_comm_volume(by_group_size=True)
    # nodes of 2 ranks: [0, 1] is one node, the world spans two
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        volume["crossing"] = comm.get_comm_volume(crossing_nodes=True)
        comm.reset_comm_volume()
        if dist.get_rank() < 2:
            comm.all_reduce(torch.ones(100), group=group)
        comm.all_reduce(torch.ones(10))
        volume["crossing_nodes_of_2"] = comm.get_comm_volume(crossing_nodes=True)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_world_size())
    comm.reset_comm_volume()
    return volume


def test_volume_two_ranks(dist_pool):
    for volume in dist_pool(2).run(_volume_of_three_ops):
        assert volume["all_reduce"] == {"count": 2, "bytes": 8000, "bus_bytes": 8000.0}
        # all_gather counts the OUTPUT, reduce_scatter the INPUT; factor (n-1)/n = 1/2
        assert volume["all_gather_into_tensor"] == {"count": 1, "bytes": 4000, "bus_bytes": 2000.0}
        assert volume["reduce_scatter_tensor"] == {"count": 1, "bytes": 4000, "bus_bytes": 2000.0}


def test_volume_four_ranks_and_subgroup(dist_pool):
    pool = dist_pool(4)
    for volume in pool.run(_volume_of_three_ops):
        assert volume["all_reduce"] == {"count": 2, "bytes": 8000, "bus_bytes": 12000.0}
        assert volume["all_gather_into_tensor"] == {"count": 1, "bytes": 4000, "bus_bytes": 3000.0}
        assert volume["reduce_scatter_tensor"] == {"count": 1, "bytes": 4000, "bus_bytes": 3000.0}
    volumes = pool.run(_volume_on_subgroup)
    for rank, volume in enumerate(volumes):
        # per group size: the world's all_reduce apart from the 2-rank group's
        world = {"all_reduce/4": {"count": 1, "bytes": 40, "bus_bytes": 60.0}}
        # one node of 4 ranks first (the pool's LOCAL_WORLD_SIZE): nothing crosses nodes
        assert volume.pop("crossing") == {}
        assert volume.pop("crossing_nodes_of_2") == {
            "all_reduce": {"count": 1, "bytes": 40, "bus_bytes": 60.0}
        }
        if rank < 2:
            # a 2-rank group: all_reduce factor 2(n-1)/n = 1
            pair = {"all_reduce/2": {"count": 1, "bytes": 400, "bus_bytes": 400.0}}
            assert volume == {**pair, **world}
        else:
            assert volume == world


def _logged_three_ops() -> dict:
    comm.reset_log()
    comm.configure(enabled=True, prof_all=True, verbose=False, debug=False)
    try:
        assert not comm.has_comm_data()
        _three_ops(1000)
        logged = comm.get_logged_comm_ops()
        count = comm.get_comm_operation_count()
        summary = comm.log_summary(show_straggler=True)
        # selection: only all_reduce when prof_all is off and it is listed
        comm.reset_log()
        comm.configure(prof_all=False, prof_ops=["all_reduce"])
        _three_ops(1000)
        comm.all_gather_into_tensor(
            torch.empty(1000), torch.ones(1000 // dist.get_world_size()), prof=True
        )
        selected = sorted(comm.get_logged_comm_ops())
    finally:
        comm.configure(enabled=False, prof_all=True, prof_ops=[])
        comm.reset_log()
    return {"logged": logged, "count": count, "summary": summary, "selected": selected}


def test_comms_logger_values(dist_pool):
    results = dist_pool(2).run(_logged_three_ops)
    for rank, result in enumerate(results):
        logged = result["logged"]
        assert set(logged) == {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
        assert set(logged["all_reduce"]) == {4000}
        assert set(logged["all_gather_into_tensor"]) == {4000}
        assert set(logged["reduce_scatter_tensor"]) == {4000}
        assert result["count"] == 3
        for name, factor in [
            ("all_reduce", 1.0),
            ("all_gather_into_tensor", 0.5),
            ("reduce_scatter_tensor", 0.5),
        ]:
            stats = logged[name][4000]
            assert stats["count"] == 1
            (latency,) = stats["latencies_ms"]
            (algbw,) = stats["algbw_gbps"]
            (busbw,) = stats["busbw_gbps"]
            assert latency > 0
            assert algbw == pytest.approx(4000 / (latency / 1e3) / 1e9)
            assert busbw == pytest.approx(algbw * factor)
        assert result["selected"] == ["all_gather_into_tensor", "all_reduce"]
        if rank == 0:
            for name in (
                "all_reduce",
                "all_gather_into_tensor",
                "reduce_scatter_tensor",
                "Straggler",
            ):
                assert name in result["summary"]
        else:
            assert result["summary"] is None


def test_configure_accepts_section_objects_and_dicts():
    logger = comm.logger.comms_logger()
    saved = (logger.enabled, logger.verbose, logger.prof_all, logger.debug, list(logger.prof_ops))
    try:
        section = SimpleNamespace(
            enabled=True, verbose=False, prof_all=False, debug=True, prof_ops=["broadcast"]
        )
        comm.configure(section)
        assert (logger.enabled, logger.prof_all, logger.debug, logger.prof_ops) == (
            True,
            False,
            True,
            ["broadcast"],
        )
        comm.configure(SimpleNamespace(comms_logger={"enabled": False}), prof_all=True)
        assert (logger.enabled, logger.prof_all) == (False, True)
        comm.configure({"comms_logger": {"enabled": True, "prof_ops": []}}, enabled=False)
        assert logger.enabled is False and logger.prof_ops == []
        with pytest.raises(ValueError, match="did you mean 'enabled'"):
            comm.configure({"enabeld": True})
    finally:
        logger.configure(
            *saved[:1], prof_all=saved[2], prof_ops=saved[4], verbose=saved[1], debug=saved[3]
        )


def test_logger_table_and_bus_factors():
    logger = CommsLogger()
    logger.append("all_reduce", "all_reduce", latency_ms=2.0, msg_size=4 * 2**20, group_size=4)
    text = logger.format_summary()
    assert "all_reduce" in text and "4.0 MB" in text
    assert comm.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert comm.bus_factor("all_gather", 8) == pytest.approx(0.875)
    assert comm.bus_factor("all_to_all_single", 2) == pytest.approx(0.5)
    assert comm.bus_factor("broadcast", 8) == 1.0
    assert format_size(10) == "10 B" and format_size(3 * 2**30) == "3.0 GB"


def test_configure_with_the_config_packages_section():
    comms_config = pytest.importorskip("shardspeed.config.comms")
    logger = comm.logger.comms_logger()
    try:
        comm.configure(
            comms_config.DeepSpeedCommsConfig(enabled=True, prof_all=False, prof_ops=["all_reduce"])
        )
        assert (logger.enabled, logger.prof_all, logger.prof_ops) == (True, False, ["all_reduce"])
    finally:
        logger.configure(enabled=False, prof_all=True, prof_ops=[])
