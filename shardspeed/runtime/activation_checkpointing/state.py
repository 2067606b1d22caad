"""The activation-checkpointing settings of this process, set by :func:`configure`.

DeepSpeed's checkpointing API is module-level (``deepspeed.checkpointing.configure(...)`` then
``checkpoint(fn, *args)`` from anywhere in the model), so the settings are one process-wide
:class:`CheckpointingSettings`. Everything else reads them through :func:`settings`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from shardspeed.config.activation_checkpointing import DeepSpeedActivationCheckpointingConfig
from shardspeed.config.loader import load_config_dict

__all__ = [
    "CheckpointingSettings",
    "configure",
    "is_configured",
    "model_parallel_group",
    "model_parallel_rank",
    "model_parallel_world_size",
    "partition_activations_in_checkpoint",
    "set_num_layers",
    "settings",
]


@dataclass
class CheckpointingSettings:
    """What :func:`configure` decided; the defaults are those of an unconfigured DeepSpeed."""

    mpu: Any = None
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    num_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    configured: bool = False
    # bumped by every configure()/reset(), so a buffer sized under old settings is dropped
    generation: int = field(default=0)


_SETTINGS = CheckpointingSettings()


def settings() -> CheckpointingSettings:
    """The process's current settings."""
    return _SETTINGS


def _section_from(deepspeed_config: Any) -> DeepSpeedActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a path, dict, ``DeepSpeedConfig`` or section."""
    if isinstance(deepspeed_config, DeepSpeedActivationCheckpointingConfig):
        return deepspeed_config
    section = getattr(deepspeed_config, "activation_checkpointing", None)
    if isinstance(section, DeepSpeedActivationCheckpointingConfig):
        return section
    if isinstance(deepspeed_config, dict | str | os.PathLike):
        raw = load_config_dict(deepspeed_config)
        # only this section is parsed: the caller may hand a partial config with no batch keys
        return DeepSpeedActivationCheckpointingConfig(**raw.get("activation_checkpointing", {}))
    raise TypeError(
        "deepspeed_config must be a path to a DeepSpeed JSON file, a config dict or a "
        f"DeepSpeedConfig, got {type(deepspeed_config).__name__}"
    )


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set up activation checkpointing for this process.

    ``mpu_`` is a Megatron-style model-parallel unit (``get_model_parallel_group``,
    ``get_model_parallel_world_size``, ``get_model_parallel_rank``) or None (no model
    parallelism). Settings come from the ``activation_checkpointing`` section of
    ``deepspeed_config`` (a path, a dict or a ``DeepSpeedConfig``); each keyword given here
    overrides its config key (``contiguous_checkpointing`` ->
    ``contiguous_memory_optimization``, ``num_checkpoints`` -> ``number_checkpoints``,
    ``checkpoint_in_cpu`` -> ``cpu_checkpointing``, ``synchronize`` ->
    ``synchronize_checkpoint_boundary``, ``profile`` -> ``profile``).
    """
    global _SETTINGS
    section = (
        _section_from(deepspeed_config)
        if deepspeed_config is not None
        else DeepSpeedActivationCheckpointingConfig()
    )

    def pick(override: Any, from_config: Any) -> Any:
        return from_config if override is None else override

    new = CheckpointingSettings(
        mpu=mpu_,
        partition_activations=bool(pick(partition_activations, section.partition_activations)),
        contiguous_memory_optimization=bool(
            pick(contiguous_checkpointing, section.contiguous_memory_optimization)
        ),
        num_checkpoints=pick(num_checkpoints, section.number_checkpoints),
        cpu_checkpointing=bool(pick(checkpoint_in_cpu, section.cpu_checkpointing)),
        synchronize=bool(pick(synchronize, section.synchronize_checkpoint_boundary)),
        profile=bool(pick(profile, section.profile)),
        configured=True,
        generation=_SETTINGS.generation + 1,
    )
    _check(new)
    _SETTINGS = new


def _check(new: CheckpointingSettings) -> None:
    if new.contiguous_memory_optimization and not new.partition_activations:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization=True needs "
            "partition_activations=True (the contiguous buffer holds activation partitions); "
            "enable partition_activations or turn contiguous_memory_optimization off."
        )
    if new.contiguous_memory_optimization and not new.num_checkpoints:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization=True needs "
            "number_checkpoints (num_checkpoints=) to size the buffer: set it to the number of "
            "checkpoint() calls per forward, e.g. the number of layers."
        )
    if new.num_checkpoints is not None and new.num_checkpoints <= 0:
        raise ValueError(
            f"num_checkpoints must be a positive number of checkpoints, got {new.num_checkpoints}"
        )


def is_configured() -> bool:
    """True once :func:`configure` has run (and :func:`reset` has not undone it since)."""
    return _SETTINGS.configured


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn activation partitioning on or off after :func:`configure`."""
    _SETTINGS.partition_activations = bool(partition_activation)
    _SETTINGS.generation += 1


def set_num_layers(nlayers: int) -> None:
    """Set the number of checkpoints per forward (sizes the contiguous buffer)."""
    _SETTINGS.num_checkpoints = int(nlayers)
    _SETTINGS.generation += 1


def bump_generation() -> None:
    """Mark every buffer sized under the current settings as stale (used by ``reset()``)."""
    _SETTINGS.generation += 1


def _mpu_call(names: tuple[str, ...], default: Any) -> Any:
    mpu = _SETTINGS.mpu
    if mpu is None:
        return default
    for name in names:
        method = getattr(mpu, name, None)
        if method is not None:
            return method()
    raise TypeError(
        f"the mpu passed to checkpointing.configure() has none of {', '.join(names)}; pass a "
        "Megatron-style model-parallel unit or None."
    )


def model_parallel_world_size() -> int:
    """Size of the model-parallel group activations are partitioned over (1 without an mpu)."""
    return int(
        _mpu_call(("get_model_parallel_world_size", "get_tensor_model_parallel_world_size"), 1)
    )


def model_parallel_rank() -> int:
    """This process's rank in the model-parallel group (0 without an mpu)."""
    return int(_mpu_call(("get_model_parallel_rank", "get_tensor_model_parallel_rank"), 0))


def model_parallel_group() -> Any:
    """The model-parallel process group (None without an mpu)."""
    return _mpu_call(("get_model_parallel_group", "get_tensor_model_parallel_group"), None)
