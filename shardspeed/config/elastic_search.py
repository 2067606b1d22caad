"""DeepSpeed's elastic batch-size search, versions 0.1 and 0.2, with its results.

Version 0.1 works on GPU counts. Candidate global batch sizes are each acceptable micro-batch
size, and their least common multiple, scaled by the largest highly composite number that keeps
them within ``max_train_batch_size`` (highly composite numbers have the most divisors, so the
batch divides evenly among many GPU counts). The candidate that divides evenly among the most GPU
counts in ``[min_gpus, max_gpus]`` wins (ties: the larger batch if ``prefer_larger_batch``).

Version 0.2 works on nodes: the same search over node counts with the batch per data-parallel
rank of a node (``num_gpus_per_node / model_parallel_size`` ranks each), scaled back; when the
current data-parallel size is not among the valid ones it falls back to the largest (or smallest)
batch the current size can run.

A scheduler and every rank must see the same answer, so the search is deterministic.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from shardspeed.config.elasticity import ElasticityConfig
from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.utils.logging import logger

LATEST_ELASTICITY_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
#: the environment variable a scheduler sets to the elastic config it planned with
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"

#: the 38 smallest highly composite numbers (batch sizes up to ~720K)
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
    7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
    221760, 277200, 332640, 498960, 554400, 665280, 720720,
)  # fmt: skip


class ElasticityError(Exception):
    """The elastic configuration cannot be used (e.g. an incompatible DeepSpeed version)."""


class ElasticityConfigError(ElasticityError, DeepSpeedConfigError):
    """The ``elasticity`` section is missing, disabled or inconsistent."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The job's world size is not one of the elastic configuration's valid GPU counts."""


def _scaled(base: int, limit: int) -> int:
    """``base`` times the largest highly composite number keeping it <= ``limit``."""
    best = base
    for factor in HIGHLY_COMPOSITE:
        if base * factor > limit:
            break
        best = base * factor
    return best


def _gpu_counts(batch: int, micro_batches: list[int], low: int, high: int) -> list[int]:
    """The GPU counts in ``[low, high]`` among which ``batch`` splits into whole micro-batches
    of one of ``micro_batches`` (with gradient accumulation making up the rest)."""
    counts: set[int] = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        most = batch // micro
        counts.update(n for n in range(1, most + 1) if most % n == 0 and low <= n <= high)
    return sorted(counts)


def _search_v01(
    micro_batches: list[int], max_batch: int, min_gpus: int | None, max_gpus: int | None,
    prefer_larger: bool,
) -> tuple[int, list[int]]:  # fmt: skip
    low = min_gpus or 1
    high = max_gpus or max_batch // min(micro_batches)
    if any(micro > max_batch for micro in micro_batches):
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes {micro_batches} must each be at most "
            f"max_train_batch_size ({max_batch})"
        )
    bases = [*micro_batches, math.lcm(*micro_batches)]
    candidates = sorted({_scaled(base, max_batch) for base in bases})
    chosen, valid = min(micro_batches), list[int]()
    for batch in candidates:
        counts = _gpu_counts(batch, micro_batches, low, high)
        better_tie = batch > chosen if prefer_larger else batch < chosen
        if len(counts) > len(valid) or (len(counts) == len(valid) and better_tie):
            chosen, valid = batch, counts
    return chosen, valid


def _largest_micro_batch(batch: int, ranks: int, micro_batches: list[int]) -> int | None:
    for micro in sorted(set(micro_batches), reverse=True):
        if batch // ranks % micro == 0:
            return micro
    return None


def _search_v02(config: ElasticityConfig, current_gpus: int) -> tuple[int, list[int], int | None]:
    per_node, mp = config.num_gpus_per_node, config.model_parallel_size
    if per_node % mp:
        raise ElasticityError(
            f"elasticity v0.2: num_gpus_per_node ({per_node}) must be divisible by "
            f"model_parallel_size ({mp})"
        )
    dp_per_node = per_node // mp
    micro_batches = config.micro_batch_sizes
    batch, nodes = _search_v01(
        micro_batches,
        int(config.max_train_batch_size / dp_per_node),
        int(config.min_gpus / per_node),
        int(config.max_gpus / per_node),
        config.prefer_larger_batch,
    )
    batch *= dp_per_node
    valid = [n * dp_per_node for n in nodes]

    def micro_for(total: int) -> int | None:
        # the micro-batch must divide the batch of one data-parallel rank (DeepSpeed divides
        # by the GPU count here, which finds none under model parallelism)
        fitting = [m for m in micro_batches if total // max(current_gpus // mp, 1) % m == 0]
        if not fitting:
            return None
        return max(fitting) if config.prefer_larger_batch else fitting[0]

    if current_gpus // mp in valid:
        return batch, valid, micro_for(batch)
    # the current size is not among them: the best batch this size can run
    current_dp = current_gpus / per_node * dp_per_node
    options = [
        math.floor(config.max_train_batch_size / float(m * current_dp)) * m * current_dp
        for m in micro_batches
    ]
    fallback = int(max(options) if config.prefer_larger_batch else min(options))
    return fallback, [int(current_dp)], micro_for(fallback)


def _version_tuple(version: str) -> tuple[int, ...]:
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ElasticityError(f"cannot read the version {version!r} (expected major.minor[.patch])")
    return tuple(int(part or 0) for part in found.groups())


def elasticity_enabled(ds_config: dict[str, Any]) -> bool:
    section = ds_config.get("elasticity")
    return bool(section and section.get("enabled", False))


def _section(ds_config: Any) -> ElasticityConfig:
    if not isinstance(ds_config, dict):
        raise ValueError(f"expected the DeepSpeed config as a dict, got {type(ds_config).__name__}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError(
            "'elasticity' is missing from the config; add it to run an elastic training job"
        )
    config = ElasticityConfig(**ds_config["elasticity"])
    if not config.enabled:
        raise ElasticityConfigError(
            'elasticity is disabled; set "elasticity": {"enabled": true, ...} to run an '
            "elastic training job"
        )
    return config


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict[str, Any]) -> None:
    """The elastic config this run uses must be the one the scheduler planned with (in
    ``DEEPSPEED_ELASTICITY_CONFIG``), or the scheduler may scale to a count that does not fit."""
    planned_json = os.environ.get(DEEPSPEED_ELASTICITY_CONFIG)
    if planned_json is None:
        logger.warning(
            f"{DEEPSPEED_ELASTICITY_CONFIG} is not set: cannot check that the resource scheduler "
            "scales this job to GPU counts its elastic config allows"
        )
        return
    planned = ElasticityConfig(**json.loads(planned_json))
    running = ElasticityConfig(**runtime_elastic_config_dict)
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(planned, key) != getattr(running, key):
            raise ElasticityConfigError(
                f"elasticity.{key} is {getattr(running, key)!r} here but the resource scheduler "
                f"planned with {getattr(planned, key)!r}; use the same elastic config in both"
            )


def compute_elastic_config(
    ds_config: dict[str, Any],
    target_deepspeed_version: str,
    world_size: int = 0,
    return_microbatch: bool = False,
) -> tuple[Any, ...]:
    """``(train_batch_size, valid_sizes)`` for the ``elasticity`` section of ``ds_config``, plus
    the micro-batch size when ``world_size`` (the GPU count; checked against the valid sizes) is
    given or ``return_microbatch``. Version 0.1's valid sizes are GPU counts, version 0.2's
    data-parallel sizes (GPUs / ``model_parallel_size``); 0.2 needs the GPU count (argument or
    ``WORLD_SIZE``)."""
    config = _section(ds_config)
    version = float(config.version)
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(
            f"elasticity.version {version} is newer than this runtime supports "
            f"({LATEST_ELASTICITY_VERSION})"
        )
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(
            f"elasticity version {version} does not support model parallelism "
            f"(model_parallel_size={config.model_parallel_size}); use version 0.2"
        )
    if _version_tuple(target_deepspeed_version) < _version_tuple(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(
            f"target DeepSpeed version {target_deepspeed_version} predates elasticity "
            f"(minimum {MINIMUM_DEEPSPEED_VERSION})"
        )
    micro: int | None = None
    if version == 0.1:
        batch, valid = _search_v01(
            config.micro_batch_sizes,
            config.max_train_batch_size,
            config.min_gpus,
            config.max_gpus,
            config.prefer_larger_batch,
        )
    elif version == 0.2:
        current = world_size or _world_size_from_env()
        batch, valid, micro = _search_v02(config, current)
    else:
        raise ElasticityConfigError(f"no elastic batch-size logic for version {version}")
    logger.info(f"elasticity: train batch size {batch}, valid data-parallel sizes {valid}")
    if world_size > 0:
        # version 0.2 counts GPUs and its valid sizes are data-parallel sizes
        dp = world_size // config.model_parallel_size if version == 0.2 else world_size
        if dp not in valid:
            raise ElasticityIncompatibleWorldSize(
                f"world size {world_size} (data-parallel size {dp}) is not one of the valid "
                f"sizes {valid} of this elastic config; run on one of those, or change "
                "min_gpus / max_gpus / micro_batch_sizes"
            )
        return batch, valid, _micro_or_fail(batch, dp, config.micro_batch_sizes)
    if return_microbatch:
        if version == 0.2:
            return batch, valid, micro
        return batch, valid, _micro_or_fail(batch, 1, config.micro_batch_sizes)
    return batch, valid


def _micro_or_fail(batch: int, ranks: int, micro_batches: list[int]) -> int:
    micro = _largest_micro_batch(batch, ranks, micro_batches)
    if micro is None:
        raise ElasticityError(
            f"no micro-batch size in {micro_batches} divides the per-rank batch {batch} // {ranks}"
        )
    return micro


def _world_size_from_env() -> int:
    value = os.environ.get("WORLD_SIZE", "")
    if not value.isnumeric():
        raise ElasticityConfigError(
            "elasticity version 0.2 needs the world size: pass world_size to "
            f"compute_elastic_config or set WORLD_SIZE (it is {value!r})"
        )
    return int(value)
