"""Partitioned activations on 2 real ranks, and training through the engine on 2 ranks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness.distributed import DistributedPool
from tests.runtime.activation_checkpointing import rank_fns


def test_partitioned_activations_halve_saved_bytes(
    dist_pool: Callable[[int], DistributedPool],
) -> None:
    results = dist_pool(2).run(
        rank_fns.partitioned_vs_plain, (8, 32), {"partition_activations": True}
    )
    for result in results:
        assert result["partitioned"] == 3
        assert result["split_bytes"] * 2 == result["plain_bytes"] == 3 * 8 * 32 * 4


def test_partition_pads_uneven_sizes(dist_pool: Callable[[int], DistributedPool]) -> None:
    # 3 x 5 = 15 elements: each rank keeps 8 (the second zero-padded)
    results = dist_pool(2).run(
        rank_fns.partitioned_vs_plain, (3, 5), {"partition_activations": True}
    )
    assert [r["split_bytes"] for r in results] == [3 * 8 * 4] * 2


@pytest.mark.parametrize("cpu", [False, True])
def test_partition_with_contiguous_buffer_and_cpu(
    dist_pool: Callable[[int], DistributedPool], cpu: bool
) -> None:
    options = {
        "partition_activations": True,
        "contiguous_checkpointing": True,
        "num_checkpoints": 3,
        "checkpoint_in_cpu": cpu,
    }
    for result in dist_pool(2).run(rank_fns.partitioned_vs_plain, (8, 32), options):
        assert result["split_bytes"] * 2 == result["plain_bytes"]
        assert result["buffer_bytes"] == 3 * 8 * 32 * 4 // 2
        assert result["devices"] == {"cpu"}


def test_engine_training_matches_without_checkpointing(
    dist_pool: Callable[[int], DistributedPool],
) -> None:
    results = dist_pool(2).run(rank_fns.engine_parity, 3)
    assert results[0]["losses"] != results[1]["losses"]  # each rank saw its own data
