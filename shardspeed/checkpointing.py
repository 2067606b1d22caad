"""``shardspeed.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): activation
checkpointing with partitioning, CPU checkpointing and model-parallel RNG tracking.

Re-exports only; the implementation is in :mod:`shardspeed.runtime.activation_checkpointing`.
"""

from shardspeed.runtime.activation_checkpointing.checkpointing import (
    _CUDA_RNG_STATE_TRACKER,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    CheckpointFunction,
    CheckpointStats,
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    detach_variable,
    get_cuda_rng_tracker,
    get_stats,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    reset_stats,
    set_num_layers,
)

__all__ = [
    "CheckpointFunction",
    "CheckpointStats",
    "CudaRNGStatesTracker",
    "_CUDA_RNG_STATE_TRACKER",
    "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "checkpoint",
    "configure",
    "detach_variable",
    "get_cuda_rng_tracker",
    "get_stats",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "reset_stats",
    "set_num_layers",
]
