"""The monitor tests set ``RANK`` to pose as a rank; a process group left up by an earlier test
in the same process (an engine built in-process keeps its world-1 group, as DeepSpeed's does)
would answer the rank instead, so each test here starts without one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardspeed import comm


@pytest.fixture(autouse=True)
def _no_process_group() -> Iterator[None]:
    if comm.is_initialized():
        comm.destroy_process_group()
    yield
