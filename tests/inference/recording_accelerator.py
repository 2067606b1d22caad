"""A stand-in for the CUDA accelerator that counts graph creations, captures and replays, for
testing graph orchestration without a GPU (the captured body runs eagerly once; a replay does
nothing, so only the counts mean anything)."""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import pytest

from shardspeed.inference import graph_capture


class RecordingAccelerator:
    class _Stream:
        def wait_stream(self, other: object) -> None:
            pass

    def __init__(self) -> None:
        self.created = self.captured = self.replayed = 0
        self.pools: list[object] = []

    def device_name(self) -> str:
        return "recording"

    def create_graph(self) -> object:
        self.created += 1
        return object()

    def Stream(self) -> _Stream:  # noqa: N802 - the accelerator's name
        return self._Stream()

    def current_stream(self) -> _Stream:
        return self._Stream()

    def stream(self, stream: object) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def capture_to_graph(self, graph: object, pool: object = None) -> contextlib.nullcontext[Any]:
        self.captured += 1
        self.pools.append(pool)
        return contextlib.nullcontext()

    def replay_graph(self, graph: object) -> None:
        self.replayed += 1


def install(monkeypatch: pytest.MonkeyPatch, replaying: ModuleType) -> RecordingAccelerator:
    """A recorder standing in wherever graphs are captured and in ``replaying`` (the module
    that replays them)."""
    recorder = RecordingAccelerator()
    for module in (graph_capture, replaying):
        monkeypatch.setattr(module, "get_accelerator", lambda: recorder)
    return recorder
