"""``elasticity.compute_elastic_config`` (DeepSpeed's search, versions 0.1 and 0.2) and the
config computing its batch sizes from it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import shardspeed
from shardspeed.config import DeepSpeedConfig
from shardspeed.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

BASE: dict[str, Any] = {
    "elasticity": {
        "enabled": True,
        "max_train_batch_size": 10000,
        "micro_batch_sizes": [8, 12, 16, 17],
        "min_gpus": 32,
        "max_gpus": 1500,
        "min_time": 20,
        "version": 0.1,
    }
}


def _config(**changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(BASE)
    config["elasticity"].update(changes)
    return config


def test_v01_batch_and_gpu_counts():
    """The batch with the most valid GPU counts in [32, 1500]: 9792 = 17 x 576, 23 counts, each
    dividing the batch into whole micro-batches of an allowed size."""
    batch, valid = compute_elastic_config(BASE, "0.16.0")
    assert batch == 9792
    assert len(valid) == 23 and valid[0] == 32 and valid[-1] == 1224
    for gpus in valid:
        assert any(batch % (gpus * micro) == 0 for micro in (8, 12, 16, 17))


def test_world_size_gives_the_largest_fitting_micro_batch():
    assert compute_elastic_config(BASE, "0.16.0", world_size=64) == (
        9792,
        compute_elastic_config(BASE, "0.16.0")[1],
        17,
    )
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 33"):
        compute_elastic_config(BASE, "0.16.0", world_size=33)


def test_prefer_larger_or_smaller_batch_breaks_ties():
    """Micro-batches 2 and 3 up to 20: candidates 12 and 18 both split over 5 GPU counts; the
    preference picks between them."""
    small = {"max_train_batch_size": 20, "micro_batch_sizes": [2, 3], "min_gpus": 1, "max_gpus": 20}
    assert compute_elastic_config(_config(**small), "0.16.0") == (18, [1, 2, 3, 6, 9])
    smaller = _config(**small, prefer_larger_batch=False)
    assert compute_elastic_config(smaller, "0.16.0") == (12, [1, 2, 3, 4, 6])


def test_refusals():
    with pytest.raises(ElasticityConfigError, match="missing"):
        compute_elastic_config({}, "0.16.0")
    with pytest.raises(ElasticityConfigError, match="disabled"):
        compute_elastic_config(_config(enabled=False), "0.16.0")
    with pytest.raises(ElasticityConfigError, match="at most"):
        compute_elastic_config(_config(max_train_batch_size=10), "0.16.0")
    with pytest.raises(ElasticityConfigError, match="newer"):
        compute_elastic_config(_config(version=0.3), "0.16.0")
    with pytest.raises(ElasticityError, match="predates"):
        compute_elastic_config(BASE, "0.2.0")
    with pytest.raises(ElasticityConfigError, match="model parallel"):
        compute_elastic_config(_config(model_parallel_size=2), "0.16.0")


def test_v02_model_parallel_by_node(monkeypatch):
    """Version 0.2 searches node counts: data-parallel sizes come in multiples of the ranks per
    node (8 GPUs / model-parallel 4 = 2), and the micro-batch divides the per-rank batch."""
    config = _config(version=0.2, model_parallel_size=4, num_gpus_per_node=8, max_gpus=1500)
    monkeypatch.setenv("WORLD_SIZE", "64")
    batch, valid, micro = compute_elastic_config(config, "0.16.0", return_microbatch=True)
    assert all(size % 2 == 0 for size in valid)
    assert micro is not None and (batch // (64 // 4)) % micro == 0  # per data-parallel rank
    monkeypatch.setenv("WORLD_SIZE", "not-a-number")
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(config, "0.16.0")
    with pytest.raises(ElasticityError, match="divisible"):
        compute_elastic_config(
            _config(version=0.2, model_parallel_size=3, num_gpus_per_node=8), "0.16.0", 6
        )


def test_config_takes_its_batch_sizes_from_the_search():
    config = DeepSpeedConfig(_config(), dp_world_size=64)
    assert config.train_batch_size == 9792
    assert config.train_micro_batch_size_per_gpu == 17
    assert config.gradient_accumulation_steps == 9792 // (17 * 64)
    given = {**_config(), "train_batch_size": 32}
    with pytest.raises(ElasticityConfigError, match="ignore_non_elastic_batch_info"):
        DeepSpeedConfig(given, dp_world_size=64)
    ignored = copy.deepcopy(given)
    ignored["elasticity"]["ignore_non_elastic_batch_info"] = True
    assert DeepSpeedConfig(ignored, dp_world_size=64).train_batch_size == 9792


def test_public_path():
    assert shardspeed.elasticity.compute_elastic_config is compute_elastic_config
