"""Real multi-node launches on this machine: two ``--no_ssh`` node launchers on loopback, pdsh in
exec mode with ``localhost`` and ``127.0.0.1`` as two nodes, and Debian's OpenMPI ``mpirun``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO, TRAIN, free_port, job_env, run_shardspeed, shardspeed_cmd

TWO_NODES = "localhost slots=1\n127.0.0.1 slots=1\n"


def assert_trained(output: str, world: int) -> None:
    for rank in range(world):
        assert f"TRAIN_OK rank={rank} world={world}" in output, output


@pytest.mark.timeout(90)
def test_two_no_ssh_node_launchers_on_loopback(hostfile) -> None:
    path = hostfile(TWO_NODES)
    common = [
        "-H",
        path,
        "--no_ssh",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    procs = [
        subprocess.Popen(
            shardspeed_cmd(*common, "--node_rank", str(n), TRAIN, "--steps", "3"),
            env=job_env(),
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    outputs = [p.communicate(timeout=80)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "TRAIN_OK rank=0 world=2 local_rank=0" in outputs[0]
    assert "TRAIN_OK rank=1 world=2 local_rank=0" in outputs[1]


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    shutil.which("pdsh") is None, reason="pdsh not installed (apt-get install pdsh)"
)
def test_pdsh_exec_mode_two_nodes(hostfile) -> None:
    result = run_shardspeed(
        "-H",
        hostfile(TWO_NODES),
        "--launcher",
        "pdsh",
        "--launcher_args",
        "-R exec",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        TRAIN,
        "--steps",
        "3",
        timeout=80,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # pdsh prefixes every line with the host it came from
    assert "localhost: TRAIN_OK rank=0 world=2" in result.stdout
    assert "127.0.0.1: TRAIN_OK rank=1 world=2" in result.stdout


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    shutil.which("pdsh") is None, reason="pdsh not installed (apt-get install pdsh)"
)
def test_pdsh_failure_propagates(hostfile, tmp_path: Path) -> None:
    script = tmp_path / "fail_on_node1.sh"
    script.write_text('[ "$RANK" = 1 ] && exit 5; exit 0\n')
    result = run_shardspeed(
        "-H",
        hostfile(TWO_NODES),
        "--launcher_args",
        "-R exec",
        "--no_python",
        "--no_local_rank",
        "/bin/sh",
        str(script),
        timeout=60,
    )
    assert result.returncode == 5, result.stdout + result.stderr
    assert "rank 1 (local rank 0, pid" in result.stdout and "exited with code 5" in result.stdout


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)"
)
def test_openmpi_two_ranks(hostfile) -> None:
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version:
        pytest.skip(f"mpirun is not Open MPI: {version.splitlines()[:1]}")
    result = run_shardspeed(
        "-H",
        hostfile("localhost slots=2\n"),
        "--force_multi",
        "--launcher",
        "openmpi",
        "--launcher_args",
        "--oversubscribe",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        TRAIN,
        "--steps",
        "3",
        timeout=80,
        # launched from a process that has a rank itself (an engine built in-process exports
        # these): the MPI ranks must still take theirs from mpirun, not all be rank 0 of 1
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert_trained(result.stdout, 2)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (REPO / "examples" / "train_gpt.py").exists(), reason="no GPT example")
def test_gpt_example_on_two_cpu_ranks() -> None:
    result = run_shardspeed(
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "examples/train_gpt.py",
        "--deepspeed_config",
        "examples/gpt_config.json",
        "--steps",
        "3",
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr
