"""The job's one topology: the mesh arithmetic, the group registry, the views for MiCS and
expert parallelism, and ``utils.groups`` / ``mpu`` queries answering from it on live ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed import comm
from shardspeed.comm.mesh import Mesh, group_registry
from shardspeed.comm.parallel_topology import ParallelTopology, current_topology
from shardspeed.utils import groups
from tests.runtime.mpu_tp_ranks import MegatronMpu


def test_mesh_groups_along_axes_and_reshape() -> None:
    mesh = Mesh.grid({"pp": 2, "dp": 2, "tp": 2}, rank=5)
    assert mesh.coordinate() == {"pp": 1, "dp": 0, "tp": 1}
    assert mesh.rank_lists("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.rank_lists("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.rank_lists("pp", "tp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mesh.ranks("dp") == [5, 7] and mesh.local_rank("pp") == 1
    split = mesh.reshape(("pp", "edp", "ep", "tp"), (2, 1, 2, 2))
    assert split.rank_lists("ep") == mesh.rank_lists("dp")
    with pytest.raises(ValueError, match="did you mean 'pp'"):
        mesh.size("dpp")
    with pytest.raises(ValueError, match="each rank"):
        Mesh(torch.tensor([[0, 1], [1, 3]]), ("a", "b"))
    with pytest.raises(RuntimeError, match="no process groups"):
        mesh.group("tp")


def test_parallel_topology_views() -> None:
    topo = ParallelTopology.build(pp=2, tp=2, world_size=16, rank=6)
    assert topo.sizes == {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "sp": 1, "tp": 2}
    assert topo.ranks("dp") == [0, 2, 4, 6] and topo.local_rank("dp") == 3
    mics = topo.with_dp_shard(2)
    assert mics.ranks("dp_shard") == [4, 6] and mics.ranks("dp_replicate") == [2, 6]
    assert mics.ranks("dp") == topo.ranks("dp")
    experts = topo.expert_mesh(2)
    assert experts.ranks("ep") == [4, 6] and experts.ranks("edp") == [2, 6]
    before = topo.expert_mesh(2, data_before_expert=True)
    assert before.ranks("edp") == [4, 6] and before.ranks("ep") == [2, 6]
    with pytest.raises(ValueError, match="must divide the data-parallel size"):
        topo.expert_mesh(3)
    with pytest.raises(ValueError, match="does not divide the world size 16"):
        ParallelTopology.build(pp=3, world_size=16)


def _mpu_answers() -> dict[str, Any]:
    mpu = MegatronMpu(tp=2)
    groups.initialize(mpu=mpu)
    topo = current_topology()
    answers = {
        "adopted": groups._get_data_parallel_group() is mpu.get_data_parallel_group()
        and groups._get_model_parallel_group() is mpu.get_model_parallel_group(),
        "dp": (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
        "tp": (groups._get_model_parallel_world_size(), groups._get_model_parallel_rank()),
        "sp": groups._get_sequence_parallel_world_size(),
        "mpu": groups.get_mpu() is mpu,
        "dp_ranks": topo.ranks("dp"),
        "sdp": groups._get_sequence_data_parallel_world_size(),
    }
    try:
        groups._get_sequence_parallel_group()
    except RuntimeError as error:
        answers["no_sp"] = "no sequence-parallel group" in str(error)
    try:
        groups._create_expert_and_data_parallel(2)
    except NotImplementedError as error:
        answers["ep_refused"] = "model or sequence parallelism" in str(error)
    # MiCS inside this data-parallel axis: shard groups of 1 replicated over the 2 dp ranks
    mics = topo.with_dp_shard(1)
    answers["mics"] = (mics.ranks("dp_shard"), mics.ranks("dp_replicate"))
    groups.initialize(mpu=None)
    answers["after"] = groups._get_data_parallel_world_size()
    return answers


def _mismatched_mpu() -> str:
    class Shifted(MegatronMpu):
        def get_data_parallel_rank(self) -> int:  # lies about where this rank sits
            return (self.dp_rank + comm.get_rank() // 2) % self.dp

    try:
        ParallelTopology.from_mpu(Shifted(tp=2))
    except ValueError as error:
        return str(error)
    return "accepted"


def _expert_groups() -> dict[str, Any]:
    groups.initialize(mpu=None)
    groups._create_expert_and_data_parallel(2)
    name = groups.expert_group_name(2)
    made = len(group_registry())
    groups._create_expert_and_data_parallel(2)  # a second call makes nothing
    topo = current_topology()
    again = topo.expert_mesh(2).group("ep")  # the same ranks: the same group
    return {
        "ep": groups._get_expert_parallel_ranks(name),
        "edp": groups._get_expert_data_parallel_ranks(name),
        "sizes": (
            groups._get_expert_parallel_world_size(name),
            groups._get_expert_data_parallel_world_size(name),
        ),
        "same": again is groups._get_expert_parallel_group(name) and made == len(group_registry()),
        "max": groups._get_max_expert_size(),
    }


@pytest.mark.timeout(180)
def test_groups_answer_from_the_topology_on_four_ranks(dist_pool) -> None:
    pool = dist_pool(4)
    answers = pool.run(_mpu_answers)
    for rank, got in enumerate(answers):
        assert got["adopted"] and got["mpu"]  # the mpu's own groups answer
        assert got["dp"] == (2, rank // 2) and got["tp"] == (2, rank % 2)
        assert got["sp"] == 1 and got["no_sp"] and got["ep_refused"] and got["sdp"] == 2
        assert got["dp_ranks"] == [rank % 2, rank % 2 + 2]
        assert got["mics"] == ([rank], [rank % 2, rank % 2 + 2])
        assert got["after"] == 4
    errors = pool.run(_mismatched_mpu)
    assert all("the mpu" in e for e in errors), errors
    experts = pool.run(_expert_groups)
    for rank, got in enumerate(experts):
        assert got["ep"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["edp"] == [rank % 2, rank % 2 + 2]
        assert got["sizes"] == (2, 2) and got["same"] and got["max"] == 2


def test_no_process_group_is_made_outside_comm() -> None:
    """Every group comes from the topology's registry: no ``new_group`` call outside comm/."""
    import pathlib
    import re

    package = pathlib.Path(__file__).resolve().parents[2] / "shardspeed"
    calls = re.compile(r"\bnew_(?:sub)?groups?\(|new_subgroups")
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.parent.name != "comm" and calls.search(path.read_text())
    ]
    assert offenders == []
