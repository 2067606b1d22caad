"""Helpers for launcher tests: free ports, script paths, and running the CLI as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]
TRAIN = str(SCRIPTS / "train_allreduce.py")
PRINT_ENV = str(SCRIPTS / "print_env.py")


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shardspeed_cmd(*args: str) -> list[str]:
    """The ``shardspeed`` command line, through the interpreter running the tests."""
    return [sys.executable, "-m", "shardspeed.launcher.runner", *args]


def job_env(**extra: str) -> dict[str, str]:
    """The environment for launched jobs: this one, with the repo importable and MPI allowed as root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["DS_ACCELERATOR"] = "cpu"
    env.update(extra)
    return env


def run_shardspeed(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``shardspeed args`` to completion and capture its output."""
    return subprocess.run(
        shardspeed_cmd(*args),
        env=job_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


@pytest.fixture
def hostfile(tmp_path: Path):
    """``hostfile(text)`` writes a hostfile and returns its path."""

    count = iter(range(1000))

    def write(text: str) -> str:
        path = tmp_path / f"hostfile{next(count)}"
        path.write_text(text)
        return str(path)

    return write
