"""The per-node launcher on this machine: rank variables, options, failure and signal handling.

These use a torch-free script, so each job takes a fraction of a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from .conftest import PRINT_ENV, REPO, SCRIPTS, job_env, run_shardspeed, shardspeed_cmd


def records(out: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_rank_environment(tmp_path: Path) -> None:
    result = run_shardspeed(
        "--num_gpus",
        "3",
        "--master_port",
        "29555",
        PRINT_ENV,
        str(tmp_path),
        "--flag",
        "x",
        SHARDSPEED_TEST_MARKER="m",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    recs = records(tmp_path)
    assert sorted(recs) == [0, 1, 2]
    for rank, rec in recs.items():
        assert rec["RANK"] == rec["LOCAL_RANK"] == str(rank)
        assert rec["WORLD_SIZE"] == rec["LOCAL_WORLD_SIZE"] == rec["LOCAL_SIZE"] == "3"
        assert (rec["CROSS_RANK"], rec["CROSS_SIZE"]) == ("0", "1")
        assert (rec["MASTER_ADDR"], rec["MASTER_PORT"]) == ("127.0.0.1", "29555")
        assert rec["SHARDSPEED_TEST_MARKER"] == "m"
        assert rec["argv"] == [f"--local_rank={rank}", str(tmp_path), "--flag", "x"]


@pytest.mark.timeout(60)
def test_module_no_local_rank_and_no_python(tmp_path: Path) -> None:
    out1, out2 = tmp_path / "m", tmp_path / "p"
    out1.mkdir()
    out2.mkdir()
    env = {"PYTHONPATH": f"{SCRIPTS}{os.pathsep}{REPO}"}
    result = run_shardspeed(
        "--num_gpus", "2", "--module", "--no_local_rank", "print_env", str(out1), **env
    )
    assert result.returncode == 0, result.stdout
    assert [r["argv"] for r in records(out1).values()] == [[str(out1)], [str(out1)]]
    result = run_shardspeed(
        "--num_gpus",
        "2",
        "--no_python",
        "--no_local_rank",
        "/bin/sh",
        "-c",
        f'echo "$RANK/$WORLD_SIZE" > {out2}/$RANK.txt',
    )
    assert result.returncode == 0, result.stdout
    assert sorted(p.read_text() for p in out2.glob("*.txt")) == ["0/2\n", "1/2\n"]


@pytest.mark.timeout(60)
def test_each_rank_log_and_core_binding(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    cores = sorted(os.sched_getaffinity(0))
    result = run_shardspeed(
        "--num_gpus",
        "2",
        "--enable_each_rank_log",
        str(logs),
        "--bind_cores_to_rank",
        PRINT_ENV,
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout
    assert "hello from rank" not in result.stdout  # it went to the rank logs
    texts = {p.name.split("_rank")[1]: p.read_text() for p in logs.glob("*_rank*.log")}
    assert texts == {"0.log": "hello from rank 0\n", "1.log": "hello from rank 1\n"}
    recs = records(tmp_path)
    per_rank = len(cores) // 2
    assert recs[0]["affinity"] == cores[:per_rank]
    assert recs[1]["affinity"] == cores[per_rank : 2 * per_rank]
    assert recs[0]["OMP_NUM_THREADS"] == str(per_rank)
    single = tmp_path / "single"
    single.mkdir()
    result = run_shardspeed(
        "--bind_cores_to_rank", "--bind_core_list", str(cores[-1]), PRINT_ENV, str(single)
    )
    assert result.returncode == 0, result.stdout
    assert records(single)[0]["affinity"] == [cores[-1]]


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_shardspeed(
        "--num_gpus",
        "3",
        PRINT_ENV,
        str(tmp_path),
        "--hang",
        "--exit_rank",
        "1",
        "--exit_code",
        "7",
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 7
    recs = records(tmp_path)
    pid = recs[1]["pid"]
    assert (
        f"rank 1 (local rank 1, pid {pid}) exited with code 7; terminating the other 2 running "
        "local rank(s) and exiting with code 7"
    ) in result.stdout
    assert elapsed < 10  # the survivors would sleep 60 s
    assert not any(psutil.pid_exists(r["pid"]) for r in recs.values())


@pytest.mark.timeout(60)
def test_sigterm_is_forwarded_and_pid_file(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        shardspeed_cmd("--save_pid", "--num_gpus", "2", PRINT_ENV, str(tmp_path), "--hang"),
        env=job_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: len(records(tmp_path)) == 2)
        pid_file = Path(f"/tmp/{proc.pid}.shardspeed")
        wait_for(pid_file.exists)
        launcher_pid, rank_pids = pid_file.read_text().split()
        recs = records(tmp_path)
        assert int(launcher_pid) == proc.pid  # one node: the runner is the node launcher
        assert sorted(map(int, rank_pids.split(","))) == sorted(r["pid"] for r in recs.values())
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert time.monotonic() - start < 2.0
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM; forwarding it to 2 local rank(s)" in out
    assert not any(psutil.pid_exists(r["pid"]) for r in recs.values())
    assert not pid_file.exists()


@pytest.mark.timeout(60)
def test_launcher_killed_takes_ranks_with_it(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        shardspeed_cmd("--num_gpus", "2", PRINT_ENV, str(tmp_path), "--hang"),
        env=job_env(),
        cwd=str(REPO),
        stdout=subprocess.DEVNULL,
    )
    wait_for(lambda: len(records(tmp_path)) == 2)
    proc.kill()
    proc.wait(timeout=10)
    pids = [r["pid"] for r in records(tmp_path).values()]
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), timeout=5)
