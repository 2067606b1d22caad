"""The ``shardspeed`` CLI: flags, resource resolution, errors, and a cheap start (no torch)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from shardspeed.launcher import runner
from shardspeed.launcher.runner import check_args, node_launch_argv, parse_args, resolve_resources
from shardspeed.launcher.world_info import decode_world_info

from .conftest import REPO, job_env, run_shardspeed


def test_defaults_match_deepspeed() -> None:
    args = parse_args(["train.py", "--lr", "0.1"])
    assert args.hostfile is None and args.include == "" and args.exclude == ""
    assert (args.num_nodes, args.num_gpus, args.node_rank, args.master_port) == (-1, -1, -1, 29500)
    assert (args.master_addr, args.launcher, args.launcher_args) == ("", "pdsh", "")
    assert args.enable_each_rank_log == "None" and args.autotuning == ""
    assert (args.min_elastic_nodes, args.max_elastic_nodes) == (-1, -1)
    assert args.user_script == "train.py" and args.user_args == ["--lr", "0.1"]


def test_aliases_and_script_args_untouched() -> None:
    args = parse_args(
        [
            "--num_accelerators",
            "3",
            "-H",
            "hf",
            "-i",
            "a:0",
            "s.py",
            "--num_gpus",
            "9",
            "--launcher_args",
            "x",
        ]
    )
    assert args.num_gpus == 3 and args.hostfile == "hf" and args.include == "a:0"
    assert args.user_args == ["--num_gpus", "9", "--launcher_args", "x"]


def test_launcher_args_starting_with_dash() -> None:
    args = parse_args(["--launcher", "openmpi", "--launcher_args", "--oversubscribe -x A", "s.py"])
    assert args.launcher_args == "--oversubscribe -x A"
    assert parse_args(["--launcher_args=-R exec", "s.py"]).launcher_args == "-R exec"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--elastic_training", "s.py"], "--elastic_training is not implemented in shardspeed yet"),
        (["--module", "--no_python", "s.py"], "--module and --no_python contradict each other"),
        (["--master_port", "70000", "s.py"], "--master_port 70000 is not a TCP port; use 1..65535"),
        (["--launcher", "torchrun", "s.py"], "unknown --launcher 'torchrun'; choose one of pdsh"),
        (["--bind_core_list", "0-3", "s.py"], "--bind_core_list needs --bind_cores_to_rank"),
    ],
)
def test_bad_flags(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        check_args(parse_args(argv))


def test_local_cpu_resources(monkeypatch) -> None:
    monkeypatch.setattr(runner, "local_accelerator_count", lambda: None)
    monkeypatch.setattr(runner, "fetch_hostfile", lambda path: None)
    assert resolve_resources(parse_args(["s.py"])) == ({"localhost": [0]}, False)
    assert resolve_resources(parse_args(["--num_gpus", "3", "s.py"]))[0] == {"localhost": [0, 1, 2]}
    assert resolve_resources(parse_args(["--num_gpus", "3", "-e", "localhost:1", "s.py"]))[0] == {
        "localhost": [0, 2]
    }
    with pytest.raises(ValueError, match="--num_nodes 2 needs a hostfile listing the nodes"):
        resolve_resources(parse_args(["--num_nodes", "2", "s.py"]))


def test_local_gpu_resources(monkeypatch) -> None:
    monkeypatch.setattr(runner, "local_accelerator_count", lambda: 4)
    monkeypatch.setattr(runner, "fetch_hostfile", lambda path: None)
    assert resolve_resources(parse_args(["s.py"]))[0] == {"localhost": [0, 1, 2, 3]}
    assert resolve_resources(parse_args(["-i", "localhost:1,3", "s.py"]))[0] == {
        "localhost": [1, 3]
    }
    with pytest.raises(ValueError, match="--num_gpus 8 but host 'localhost' has only 4"):
        resolve_resources(parse_args(["--num_gpus", "8", "s.py"]))


def test_hostfile_resources(hostfile) -> None:
    path = hostfile("w0 slots=4\nw1 slots=4\nw2 slots=2\n")
    args = parse_args(["-H", path, "--num_nodes", "2", "--num_gpus", "2", "s.py"])
    assert resolve_resources(args) == ({"w0": [0, 1], "w1": [0, 1]}, True)


def test_node_launch_argv() -> None:
    args = parse_args(
        [
            "--master_port",
            "1234",
            "--no_local_rank",
            "--enable_each_rank_log",
            "/logs",
            "--bind_cores_to_rank",
            "s.py",
            "a",
        ]
    )
    argv = node_launch_argv(args, {"h": [0, 1]}, 0, "10.0.0.1")
    assert decode_world_info(argv[0].split("=", 1)[1]) == {"h": [0, 1]}
    assert argv[1:] == [
        "--node_rank=0",
        "--master_addr=10.0.0.1",
        "--master_port=1234",
        "--enable_each_rank_log=/logs",
        "--bind_cores_to_rank",
        "--no_local_rank",
        "s.py",
        "a",
    ]


def test_cli_errors_exit_2_with_message(hostfile) -> None:
    bad = hostfile("w0 slots=2\nw0 slots=2\n")
    cases = [
        (["-H", bad, "s.py"], f"hostfile {bad} line 2: host 'w0' is listed twice"),
        (["-H", bad + ".missing", "s.py"], f"hostfile {bad}.missing not found"),
        (["-i", "nohost", "s.py"], "--include: host 'nohost' is not in the hostfile"),
        (
            ["-H", hostfile("a slots=1\nb slots=1\n"), "--no_ssh", "s.py"],
            "--no_ssh with 2 nodes needs --node_rank 0..1",
        ),
    ]
    for argv, message in cases:
        result = run_shardspeed(*argv, timeout=20)
        assert result.returncode == 2, result
        assert message in result.stdout + result.stderr


def test_missing_backend_binary(hostfile) -> None:
    path = hostfile("a slots=1\nb slots=1\n")
    result = run_shardspeed(
        "-H", path, "--launcher", "slurm", "s.py", timeout=20, PATH="/nonexistent"
    )
    assert result.returncode == 2
    assert (
        "--launcher slurm needs `srun` on PATH and it is not there; run inside a Slurm "
        "allocation, or pick another --launcher" in result.stdout
    )


def test_no_torch_and_fast_start() -> None:
    code = (
        "import sys, shardspeed.launcher.runner, shardspeed.launcher.launch; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    start = time.monotonic()
    help_run = subprocess.run(
        [sys.executable, "-m", "shardspeed.launcher.runner", "--help"],
        capture_output=True,
        text=True,
        env=job_env(),
        cwd=str(REPO),
    )
    assert help_run.returncode == 0 and "--hostfile" in help_run.stdout
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(60)
def test_unreachable_ssh_host_is_reported(hostfile) -> None:
    if shutil.which("pdsh") is None or shutil.which("ssh") is None:
        pytest.skip("pdsh or ssh not installed (apt-get install pdsh openssh-client)")
    path = hostfile("node-a.invalid slots=1\nnode-b.invalid slots=1\n")
    result = run_shardspeed("-H", path, "s.py", timeout=50)
    assert result.returncode == 2
    assert (
        "host 'node-a.invalid' is not reachable by password-less ssh; set up ssh keys, use "
        "--no_ssh (launch every node yourself), or skip this test with --no_ssh_check"
    ) in result.stdout
