"""Fixtures of the serving tests: the tiny Llama checkpoint, Hugging Face's reference on it,
and ``shardspeed serve`` running it as a child process (one server for the whole package,
started by the first test that asks for it) with an official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.inference.v2.serve_model import Reference, save_tiny_llama, start_server, stop_server


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="package")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="package")
def server(model_dir: Path) -> Iterator[str]:
    """The server as a child process on a free port; terminated and reaped at the end."""
    proc, url = start_server(model_dir)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="package")
def client(server: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60.0)
