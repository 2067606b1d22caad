"""Shared fixtures: pools of real gloo ranks, started once per session and world size."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.harness.distributed import DistributedPool

_POOLS: dict[int, DistributedPool] = {}


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], DistributedPool]]:
    """``dist_pool(n)`` gives the session's pool of ``n`` ranks, starting it on first use."""

    def get(world_size: int) -> DistributedPool:
        pool = _POOLS.get(world_size)
        if pool is None:
            pool = _POOLS[world_size] = DistributedPool(world_size)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
