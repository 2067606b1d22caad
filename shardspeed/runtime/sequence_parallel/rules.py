"""What the engine asks of sequence parallelism: its size (from the config's
``sequence_parallel_size`` or an ``mpu``'s sequence-parallel group, which must agree) and what
it does not combine with, refused before anything is built."""

from __future__ import annotations

from typing import Any

from shardspeed.config import DeepSpeedConfig
from shardspeed.config.loader import load_config_dict

__all__ = ["sequence_parallel_size", "check_sequence_parallel", "with_mesh_param"]


def with_mesh_param(source: Any, mesh_param: Any) -> tuple[Any, int]:
    """The config source with ``initialize(mesh_param=(data_parallel, sequence_parallel))``
    merged in (DeepSpeed's device mesh; the config's ``data_parallel_size`` /
    ``sequence_parallel_size`` must agree with it), and the sequence-parallel degree asked
    for (1 when neither sets one; a bad value is left for the config's own check)."""
    raw = load_config_dict(source)
    if mesh_param is not None:
        if (
            not isinstance(mesh_param, (tuple, list))
            or len(mesh_param) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in mesh_param)
        ):
            raise ValueError(
                f"mesh_param must be a (data_parallel_size, sequence_parallel_size) pair of "
                f"ints, got {mesh_param!r}"
            )
        for key, value in zip(
            ("data_parallel_size", "sequence_parallel_size"), mesh_param, strict=True
        ):
            if raw.get(key) is not None and raw[key] != value:
                raise ValueError(
                    f"mesh_param={tuple(mesh_param)} sets {key}={value} but the config has "
                    f"{key}={raw[key]}; make them agree (or give only one)"
                )
            raw[key] = value
        source = raw
    sp = raw.get("sequence_parallel_size")
    return source, sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 0 else 1


def _mpu_size(mpu: Any) -> int | None:
    query = getattr(mpu, "get_sequence_parallel_world_size", None)
    return None if query is None else int(query())


def sequence_parallel_size(config: DeepSpeedConfig, mpu: Any = None) -> int:
    """The sequence-parallel degree of the job (1: none); the config's
    ``sequence_parallel_size`` and an ``mpu``'s sequence-parallel group must agree."""
    asked = int(config.sequence_parallel_size or 1)
    lent = _mpu_size(mpu) if mpu is not None else None
    if lent is not None and config.sequence_parallel_size is not None and lent != asked:
        raise ValueError(
            f"sequence_parallel_size={asked} in the config but the mpu's sequence-parallel group "
            f"has {lent} ranks; make them agree (or leave sequence_parallel_size out)"
        )
    return asked if lent is None else lent


def check_sequence_parallel(config: DeepSpeedConfig, mpu: Any, world_size: int) -> None:
    """Refuse what sequence parallelism does not combine with in shardspeed, naming the fix."""
    sp = sequence_parallel_size(config, mpu)
    if world_size % sp:
        raise ValueError(
            f"sequence_parallel_size={sp} does not divide the world size {world_size}; launch a "
            f"multiple of {sp} ranks"
        )
    dp = config.data_parallel_size
    # the other axes: AutoTP's tensor parallelism, a pipeline grid's stages
    tp = max(int(config.tensor_parallel.autotp_size), 1)
    if hasattr(mpu, "get_pipe_parallel_world_size"):
        tp *= int(mpu.get_pipe_parallel_world_size())
    if dp is not None and dp * sp * tp != world_size:
        raise ValueError(
            f"data_parallel_size={dp} x sequence_parallel_size={sp}"
            + (f" x the other parallel sizes {tp}" if tp > 1 else "")
            + f" is {dp * sp * tp}, not the world size {world_size}; set data_parallel_size to "
            f"{world_size // (sp * tp)} or leave it out"
        )
    if sp == 1:
        return
    if hasattr(mpu, "get_pipe_parallel_world_size") and int(mpu.get_pipe_parallel_world_size()) > 1:
        raise NotImplementedError(
            f"sequence_parallel_size={sp} with pipeline stages: sequence parallelism inside a "
            "PipelineModule is not built in shardspeed; train without pipeline stages"
        )
    if int(config.tensor_parallel.autotp_size) > 1:
        raise NotImplementedError(
            f"sequence_parallel_size={sp} with tensor_parallel.autotp_size="
            f"{config.tensor_parallel.autotp_size} is not built in shardspeed (the Ulysses "
            "attention would need the split heads); remove one of them"
        )
    if config.expert_parallel.enabled:
        raise NotImplementedError(
            f"sequence_parallel_size={sp} with expert_parallel (AutoEP) is not built in "
            "shardspeed; remove one of them"
        )
    if int(config.zero_optimization.mics_shard_size) > 0:
        raise NotImplementedError(
            f"sequence_parallel_size={sp} with zero_optimization.mics_shard_size (MiCS) is not "
            "built in shardspeed; remove mics_shard_size (ZeRO-3 shards over every data- and "
            "sequence-parallel rank)"
        )
