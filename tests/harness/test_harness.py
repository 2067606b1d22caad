"""The harness itself: results come back per rank, failures and hangs fail fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness.distributed import RankFailure


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return dist.get_rank()


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)


def test_collective_runs_on_every_rank(dist_pool):
    assert dist_pool(2).run(_sum_of_ranks) == [1.0, 1.0]


def test_failure_names_the_rank_and_pool_recovers(dist_pool):
    pool = dist_pool(2)
    with pytest.raises(RankFailure, match="boom on rank 1"):
        pool.run(_fail_on_rank_one)
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]


def test_hang_times_out(dist_pool):
    pool = dist_pool(2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ranks \\[0\\]"):
        pool.run(_hang_on_rank_zero, timeout_s=3)
    assert time.monotonic() - start < 20
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]
