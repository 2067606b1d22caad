"""Elastic training batch sizes (``deepspeed.elasticity``): one global batch size that stays
valid over a range of GPU counts, decomposed per run into micro-batch x accumulation x ranks. The search itself sits in the config
layer (``shardspeed.config.elastic_search``), which uses it to fill in the batch sizes."""

from shardspeed.config.elastic_search import (
    LATEST_ELASTICITY_VERSION,
    MINIMUM_DEEPSPEED_VERSION,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)

__all__ = [
    "LATEST_ELASTICITY_VERSION",
    "MINIMUM_DEEPSPEED_VERSION",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "compute_elastic_config",
    "elasticity_enabled",
    "ensure_immutable_elastic_config",
]
