"""Rank discovery from launcher environments, as a pure function, and a real one-process init."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shardspeed.comm.discovery import discover, discover_rank_info, expand_nodelist, rank_info_env


def _port() -> int:
    return 40000


def _info(env: dict[str, str], **kwargs):
    return discover_rank_info(env, port_finder=_port, **kwargs)


def test_nothing_set_is_a_single_process_world():
    assert _info({}) == (0, 1, 0, "127.0.0.1", 40000)
    assert discover({}, port_finder=_port)[0] == "single"


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
    assert _info(env) == (3, 8, 1, "10.0.0.1", 1234)
    # no LOCAL_RANK: derived from LOCAL_WORLD_SIZE, else assumed single node
    assert _info({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == (
        5,
        8,
        1,
        "127.0.0.1",
        29500,
    )
    assert _info({"RANK": "2", "WORLD_SIZE": "4"}, distributed_port=555) == (
        2,
        4,
        2,
        "127.0.0.1",
        555,
    )


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "node0",
    }
    assert discover(env, port_finder=_port) == ("openmpi", (5, 8, 1, "node0", 29500))
    # multi-node without MASTER_ADDR: only MPI itself can tell rank 0's host
    del env["MASTER_ADDR"]
    assert _info(env).master_addr is None
    # single node: loopback is right
    env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "8"
    assert _info(env).master_addr == "127.0.0.1"
    # auto_mpi_discovery=False ignores MPI variables entirely
    assert _info(env, auto_mpi_discovery=False) == (0, 1, 0, "127.0.0.1", 40000)


def test_mpich_intel_mpi_and_mvapich():
    pmi = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"}
    assert discover(pmi, port_finder=_port) == ("pmi", (2, 4, 0, "127.0.0.1", 29500))
    mv2 = {
        "MV2_COMM_WORLD_RANK": "7",
        "MV2_COMM_WORLD_SIZE": "16",
        "MV2_COMM_WORLD_LOCAL_RANK": "3",
        "MASTER_ADDR": "h",
    }
    assert discover(mv2, port_finder=_port) == ("mvapich", (7, 16, 3, "h", 29500))


def test_slurm():
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08],login",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1",
    }
    assert discover(env, port_finder=_port) == ("slurm", (6, 8, 2, "gpu07", 29500))
    del env["SLURM_STEP_NODELIST"]
    assert _info(env).master_addr == "10.1.1.1"
    env["SLURM_JOB_NODELIST"] = "a1,b2"
    assert _info(env).master_addr == "a1"
    env["MASTER_ADDR"], env["MASTER_PORT"] = "explicit", "777"
    assert _info(env)[3:] == ("explicit", 777)


def test_launcher_wins_over_mpi_and_slurm_and_explicit_args_win_over_all():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "9",
        "SLURM_PROCID": "4",
        "SLURM_NTASKS": "9",
    }
    assert discover(env, port_finder=_port)[0] == "launcher"
    assert _info(env, rank=0, world_size=3)[:2] == (0, 3)
    assert discover({}, rank=1, world_size=2, port_finder=_port) == (
        "explicit",
        (1, 2, 1, "127.0.0.1", 29500),
    )


def test_invalid_values_raise():
    with pytest.raises(ValueError, match="outside world size"):
        _info({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="PMI_SIZE"):
        _info({"PMI_RANK": "0", "PMI_SIZE": "four"})


def test_expand_nodelist():
    assert expand_nodelist("node[01-03],other") == ["node01", "node02", "node03", "other"]
    assert expand_nodelist("n[1,3-4]") == ["n1", "n3", "n4"]
    assert expand_nodelist("r[1-2]-n[08-09]") == ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]
    assert expand_nodelist("solo") == ["solo"]


def test_rank_info_env_exports_torch_variables():
    exported = rank_info_env(_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}))
    assert exported == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


_SINGLE_PROCESS_SCRIPT = textwrap.dedent(
    """
    import os, torch
    import shardspeed as deepspeed
    from shardspeed.utils.logging import current_rank
    deepspeed.init_distributed()
    deepspeed.init_distributed()  # second call is a no-op
    t = torch.ones(3)
    deepspeed.comm.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    print(deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), current_rank(), t.tolist(), env)
    deepspeed.comm.destroy_process_group()
    """
)


def test_single_process_init_with_empty_environment():
    keep = ("PATH", "HOME", "PYTHONPATH", "VIRTUAL_ENV", "LANG")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env["SHARDSPEED_TIMEOUT"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", _SINGLE_PROCESS_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    head, env_text = last.split(" {", 1)
    assert head == "0 1 0 [1.0, 1.0, 1.0]"
    assert "'RANK': '0'" in env_text and "'WORLD_SIZE': '1'" in env_text
    assert "'MASTER_ADDR': '127.0.0.1'" in env_text


def test_timeout_from_environment(monkeypatch):
    from datetime import timedelta

    from shardspeed.comm import state

    monkeypatch.delenv("SHARDSPEED_TIMEOUT", raising=False)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "5")
    assert state._timeout(state.default_pg_timeout) == timedelta(minutes=5)
    monkeypatch.setenv("SHARDSPEED_TIMEOUT", "2")
    assert state._timeout(state.default_pg_timeout) == timedelta(minutes=2)
    # an explicit timeout is the caller's choice
    assert state._timeout(timedelta(seconds=7)) == timedelta(seconds=7)
    monkeypatch.setenv("SHARDSPEED_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="minutes"):
        state._timeout(state.default_pg_timeout)


def test_dist_init_required_false_without_group_is_an_error():
    from shardspeed import comm

    if comm.is_initialized():
        pytest.skip("this test process already has a process group")
    with pytest.raises(ValueError, match="dist_init_required=False"):
        comm.init_distributed(dist_init_required=False)
    with pytest.raises(RuntimeError, match="init_distributed"):
        comm.get_rank()
