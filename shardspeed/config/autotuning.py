"""``autotuning``: the launcher-driven search over ZeRO stage and micro-batch size."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["DeepSpeedAutotuningConfig"]


class DeepSpeedAutotuningConfig(DeepSpeedConfigModel):
    """``autotuning``: search space, tuner and where results go."""

    json_key: ClassVar[str] = "autotuning"

    enabled: bool = False
    """Enable autotuning (driven by ``shardspeed --autotuning``)."""
    fast: bool = True
    """Tune only the micro-batch size and ZeRO stage (off: also optimizer offload and
    reduce/prefetch bucket sizes)."""
    results_dir: str = "autotuning_results"
    """Where the summaries are written."""
    exps_dir: str = "autotuning_exps"
    """Where the experiment configs are written."""
    overwrite: bool = True
    """Overwrite earlier results."""
    start_profile_step: int = Field(default=3, ge=0)
    """First step measured in each experiment."""
    end_profile_step: int = Field(default=5, ge=0)
    """Last step measured in each experiment."""
    metric_path: str | None = None
    """File each experiment writes its metric to."""
    metric: Literal["latency", "throughput", "flops"] = "throughput"
    """What is optimized."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """Search strategy."""
    tuner_early_stopping: int = Field(default=5, ge=0)
    """Stop after this many experiments without improvement."""
    tuner_num_trials: int = Field(default=50, gt=0)
    """Maximum experiments."""
    arg_mappings: dict[str, Any] | None = None
    """Maps config keys to the training script's command-line arguments."""
    max_train_batch_size: int | None = None
    """Upper bound of the global batch size."""
    min_train_batch_size: int = Field(default=1, gt=0)
    """Lower bound of the global batch size."""
    max_train_micro_batch_size_per_gpu: int = Field(default=1024, gt=0)
    """Upper bound of the micro-batch size."""
    min_train_micro_batch_size_per_gpu: int = Field(default=1, gt=0)
    """Lower bound of the micro-batch size."""
    num_tuning_micro_batch_sizes: int = Field(default=3, gt=0)
    """Micro-batch sizes tried per stage."""
    mp_size: int = Field(default=1, gt=0)
    """Model-parallel size of the job."""
    model_info_path: str | None = None
    """Cached model information."""
    model_info: dict[str, Any] | None = None
    """Model information given inline (e.g. ``num_params``)."""
    memory_limit_gb: float | None = Field(default=None, gt=0)
    """shardspeed: memory per rank (GiB) a configuration may need; default the accelerator's
    (on CPU ranks, the machine's over the local ranks). Points estimated above it never launch."""
    activation_checkpointing: bool | Literal["auto"] | list[bool] | None = None
    """shardspeed: activation checkpointing as a search axis: ``"auto"`` (off and on) or a list
    of booleans; a plain boolean is held fixed (and counted in the memory estimate). The script
    gets it through ``arg_mappings`` (key ``autotuning.activation_checkpointing``, e.g.
    ``"--gradient_checkpointing"``)."""
    pipeline_stages: int | Literal["auto"] | list[int] | None = None
    """shardspeed: pipeline stages as a search axis: ``"auto"`` (every divisor of the world
    size) or a list of stage counts. The script builds its ``PipelineModule`` with the count it
    gets through ``arg_mappings`` (key ``autotuning.pipeline_stages``, e.g.
    ``"--pipeline_stages"``); ZeRO stages 2 and 3 are then left out of the space."""
    experiment_timeout_s: float = Field(default=600.0, gt=0)
    """shardspeed: wall-clock limit of one experiment; a slower one is recorded as a timeout."""
