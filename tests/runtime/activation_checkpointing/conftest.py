"""Each test starts from unconfigured checkpointing, empty buffers and zeroed counters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardspeed.runtime.activation_checkpointing import checkpointing, state


@pytest.fixture(autouse=True)
def fresh_checkpointing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(state, "_SETTINGS", state.CheckpointingSettings())
    checkpointing.reset()
    checkpointing.reset_stats()
    checkpointing.get_cuda_rng_tracker().reset()
    yield
    checkpointing.reset()
    checkpointing.get_cuda_rng_tracker().reset()
