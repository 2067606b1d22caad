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


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpt_gradients_bitwise_equal_with_checkpointing(
    dist_pool: Callable[[int], DistributedPool], world_size: int, stage: int
) -> None:
    # GPT with dropout, 3 steps of 2 micro-batches, under every checkpointing layout: the local
    # gradients of the first micro-step, the reduced gradients at the boundary, the losses and
    # the weights after the steps equal those of the run without checkpointing, bit for bit
    steps = 3
    results = dist_pool(world_size).run(rank_fns.gpt_checkpointing_parity, stage, steps)
    calls = steps * 2 * rank_fns.TINY.n_layer
    for rank, per_layout in enumerate(results):
        assert per_layout.keys() == rank_fns.GPT_CHECKPOINTING.keys()
        for name, result in per_layout.items():
            assert not result["differences"], (rank, name, result["differences"])
            assert result["checkpoints"] == result["recomputes"] == calls, (rank, name)
            section = rank_fns.GPT_CHECKPOINTING[name]
            partitions = section.get("partition_activations", False) and (
                world_size > 1 or section.get("contiguous_memory_optimization", False)
            )
            assert result["partitioned"] == (calls if partitions else 0), (rank, name)
            offloads = section.get("cpu_checkpointing", False)
            assert result["offloaded"] == (calls if offloads else 0), (rank, name)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameter_shared_across_checkpoint_is_refused(
    dist_pool: Callable[[int], DistributedPool], stage: int
) -> None:
    # its gradient arrives once per nested backward, after its bucket may have been reduced
    for message in dist_pool(2).run(rank_fns.shared_param_across_checkpoint, stage):
        assert "received its gradient twice" in message
        assert "non_reentrant_checkpoint" in message
