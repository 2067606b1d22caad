"""Training with a Megatron ``mpu`` (tensor parallel 2 x data parallel 2 on 4 gloo ranks): the
global gradient norm is taken over the tensor-parallel group, parameters every tensor-parallel
rank holds whole (layer norms, a row-parallel bias, a replicated head) counted once, so the
clip and the update equal the whole model's in one process."""

from __future__ import annotations

import pytest
import torch

from tests.runtime import mpu_tp_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mpu_tensor_parallel_norm_and_clip_equal_whole_model(dist_pool, stage: int) -> None:
    results = dist_pool(4).run(mpu_tp_ranks.train_against_whole, stage)
    assert sorted((r["tp_rank"], r["dp_rank"]) for r in results) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    for result in results:
        for got, expected in result["norms"]:
            assert expected > mpu_tp_ranks.CLIP  # the clip is active at every step
            assert got == pytest.approx(expected, rel=1e-5)
    # every rank agrees on the norm (one clip coefficient for the whole model)
    assert len({tuple(g for g, _ in r["norms"]) for r in results}) == 1


@pytest.mark.timeout(300)
def test_mics_shards_inside_the_mpu_data_parallel_group(dist_pool) -> None:
    """MiCS within a data-parallel group smaller than the world: tensor parallel 2 x data
    parallel 4 on 8 ranks, ZeRO-3 state sharded over pairs of data-parallel ranks and
    replicated over the other pair, equal to the whole model in one process."""
    results = dist_pool(8).run(
        mpu_tp_ranks.train_against_whole, 3, 2, {"mics_shard_size": 2}, timeout_s=240
    )
    assert sorted((r["tp_rank"], r["dp_rank"]) for r in results) == [
        (t, d) for t in range(2) for d in range(4)
    ]
    for result in results:
        assert result["shards"] == (2, 2)
        for got, expected in result["norms"]:
            assert got == pytest.approx(expected, rel=1e-5)


def test_which_parameters_count_on_which_tensor_parallel_rank() -> None:
    from torch import nn

    from shardspeed.comm.parallel_topology import ParallelTopology
    from shardspeed.runtime.zero.model_parallel_norm import (
        is_model_parallel_parameter,
        model_parallel_comm,
        tensor_parallel_duplicates,
    )

    split, old_split, whole, marked_whole = (nn.Parameter(torch.ones(2)) for _ in range(4))
    split.tensor_model_parallel = True  # type: ignore[attr-defined]
    old_split.model_parallel = True  # type: ignore[attr-defined]
    marked_whole.tensor_model_parallel = False  # type: ignore[attr-defined]
    flags = [is_model_parallel_parameter(p) for p in (split, old_split, whole, marked_whole)]
    assert flags == [True, True, False, False]
    model = nn.ParameterList([split, old_split, whole, marked_whole])
    second = ParallelTopology.build(tp=2, world_size=4, rank=1)  # tensor rank 1
    assert [id(p) for p in tensor_parallel_duplicates(model, second)] == [
        id(whole),
        id(marked_whole),
    ]
    first = ParallelTopology.build(tp=2, world_size=4, rank=2)  # tensor rank 0
    assert tensor_parallel_duplicates(model, first) == []  # rank 0 counts everything
    assert model_parallel_comm(ParallelTopology.build(sp=2, world_size=4, rank=1)) is None
