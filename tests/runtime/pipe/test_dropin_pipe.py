"""Pipeline behaviour DeepSpeed's own unit tests expect: a failure on one stage stops every
stage (no hang), the pipeline loader reads in order, ``pipeline.use_reentrant`` and
``set_checkpoint_interval``, the grid's DeepSpeed names; and the data loader leaves a caller's
sampler alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from shardspeed.runtime.dataloader import DeepSpeedDataLoader
from shardspeed.runtime.pipe.topology import _prime_factors
from tests.runtime.pipe import dropin_ranks


@pytest.mark.timeout(200)
def test_a_reading_error_on_one_stage_stops_every_stage(dist_pool):
    kinds = dist_pool(2).run(dropin_ranks.reading_errors_stop_every_stage, timeout_s=150)
    assert kinds[0] == ["ValueError", "PipelineError", "PipelineError"]
    assert kinds[1] == ["PipelineError", "ValueError", "KeyError"]


@pytest.mark.timeout(200)
def test_a_forward_error_on_one_stage_stops_every_stage(dist_pool):
    dist_pool(2).run(dropin_ranks.forward_errors_stop_every_stage, timeout_s=150)


@pytest.mark.timeout(300)
def test_a_forward_error_in_the_middle_of_four_stages(dist_pool):
    """The "absent" marker and the stand-in zeros pass through the middle stages."""
    dist_pool(4).run(dropin_ranks.forward_errors_stop_every_stage, timeout_s=250)


@pytest.mark.timeout(200)
def test_pipeline_loader_reads_in_order_and_repeats(dist_pool):
    first, last = dist_pool(2).run(dropin_ranks.loader_in_order_and_eval_keeps_it)
    in_order = [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]]
    assert first == last == in_order


@pytest.mark.timeout(200)
def test_use_reentrant_and_set_checkpoint_interval(dist_pool):
    dist_pool(2).run(dropin_ranks.reentrant_setting)


@pytest.mark.timeout(300)
def test_grid_names_and_groups(dist_pool):
    assert dist_pool(2).run(dropin_ranks.grid_as_deepspeed)[0] == {"default": [2, 1]}
    out = dist_pool(4).run(dropin_ranks.grid_as_deepspeed)
    assert out[0]["default"] == [2, 2]
    # model_parallel_size is the model axis; the model-parallel group is pipe x model
    assert [o["3d"] for o in out] == [
        [2, 4, [0, 1], 0],
        [2, 4, [0, 1], 1],
        [2, 4, [2, 3], 0],
        [2, 4, [2, 3], 1],
    ]


def test_prime_factors():
    assert _prime_factors(1) == []
    assert _prime_factors(12) == [2, 2, 3]
    for n in range(1, 40):
        assert torch.tensor(_prime_factors(n), dtype=torch.long).prod().item() == n
    with pytest.raises(ValueError):
        _prime_factors(0)


def _orders(loader: DeepSpeedDataLoader, passes: int) -> list[list[int]]:
    return [[int(v) for batch in loader for v in batch[0]] for _ in range(passes)]


def test_loader_shuffles_its_own_sampler_per_epoch_and_leaves_a_callers_alone():
    dataset = TensorDataset(torch.arange(16))
    own = DeepSpeedDataLoader(dataset, 4, False, 0, data_parallel_world_size=1)
    first, second = _orders(own, 2)
    assert sorted(first) == sorted(second) == list(range(16)) and first != second
    own.data_sampler.set_epoch(0)  # an epoch the caller sets is used as given
    assert _orders(own, 1)[0] == first
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)
    theirs = DeepSpeedDataLoader(dataset, 4, False, 0, data_sampler=sampler)
    first, second = _orders(theirs, 2)
    assert first == second and sampler.epoch == 0
