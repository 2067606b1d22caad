"""Leave the shared rank pools as other tests expect them: no sequence-parallel topology and
no "ulysses" attention registered."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.runtime.sequence_parallel import hf_model_ranks


@pytest.fixture(autouse=True, scope="module")
def _reset_pools(dist_pool) -> Iterator[None]:
    yield
    for world in (2, 4):
        pool = dist_pool(world)
        if pool.alive:
            pool.run(hf_model_ranks.reset, timeout_s=60)
