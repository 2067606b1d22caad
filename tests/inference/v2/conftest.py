"""Fixtures of the serving tests: the tiny Llama checkpoint, Hugging Face's reference on it,
and ``shardspeed serve`` running it as a child process (one server for the whole package,
started by the first test that asks for it) with an official ``openai`` client."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.inference.v2.serve_model import SERVED_NAME, Reference, save_tiny_llama

REPO = Path(__file__).resolve().parents[3]
STARTUP_S = 120.0


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="package")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def _wait_ready(proc: subprocess.Popen[str], deadline: float) -> str:
    """The base URL once the process printed its address and /health answers 200."""
    import httpx

    assert proc.stdout is not None
    url = None
    lines: list[str] = []
    while url is None:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"server did not start: {''.join(lines)}")
        line = proc.stdout.readline()
        lines.append(line)
        found = re.search(r"listening on (http://\S+)", line)
        url = found.group(1) if found else None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never became healthy")


@pytest.fixture(scope="package")
def server(model_dir: Path) -> Iterator[str]:
    """The server as a child process on a free port; terminated and reaped at the end."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "shardspeed.launcher.runner", "serve", "--model", str(model_dir),
        "--port", "0", "--served-model-name", SERVED_NAME, "--max-batch-tokens", "64",
        "--kv-block-size", "8", "--kv-blocks", "64", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield _wait_ready(proc, time.monotonic() + STARTUP_S)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture(scope="package")
def client(server: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60.0)
