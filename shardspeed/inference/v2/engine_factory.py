"""``build_hf_engine``: an :class:`InferenceEngineV2` from a Hugging Face model or its path."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.inference.autotp import apply_plan
from shardspeed.inference.config import DeepSpeedTPConfig
from shardspeed.inference.tp_group import resolve_tp_group
from shardspeed.inference.tp_plan import build_plan
from shardspeed.inference.v2.config_v2 import RaggedInferenceEngineConfig
from shardspeed.inference.v2.engine_v2 import InferenceEngineV2
from shardspeed.inference.v2.model.ragged_lm import SUPPORTED_FAMILIES, RaggedCausalLM
from shardspeed.inference.v2.serialization import is_serialized_engine, load_model
from shardspeed.inference.weight_source import ModuleWeights
from shardspeed.utils.logging import logger

__all__ = ["build_engine_from_ds_checkpoint", "build_hf_engine"]


def build_hf_engine(
    path_or_model: str | os.PathLike[str] | nn.Module,
    engine_config: RaggedInferenceEngineConfig | dict[str, Any] | None = None,
    debug_level: int | None = None,
) -> InferenceEngineV2:
    """An engine over a Hugging Face causal LM: ``path_or_model`` is a local checkpoint
    directory (loaded with ``from_pretrained``, local files only) or a model already built.
    With ``tensor_parallel.tp_size`` > 1 the model is split by AutoTP over consecutive ranks
    (the process group is started when needed); each rank's KV cache holds its own kv heads,
    and every rank must make the same ``put``/``flush`` calls."""
    if engine_config is None or isinstance(engine_config, dict):
        engine_config = RaggedInferenceEngineConfig.from_dict(engine_config or {})
    if not isinstance(path_or_model, nn.Module) and is_serialized_engine(path_or_model):
        return build_engine_from_ds_checkpoint(path_or_model, engine_config, debug_level)
    if debug_level is not None:
        logger.setLevel(debug_level)
    model = _load(path_or_model, engine_config)
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in SUPPORTED_FAMILIES:  # before any sharding work
        RaggedCausalLM(model)
    dtype = engine_config.resolved_dtype(next(model.parameters()).dtype)
    device = torch.device(get_accelerator().current_device_name())
    tp_config = engine_config.tensor_parallel
    tp = resolve_tp_group(
        DeepSpeedTPConfig(tp_size=tp_config.tp_size, tp_grain_size=tp_config.tp_grain_size)
    )
    if tp.size > 1:
        plan = build_plan(model, tp.size, tp.rank, tp_config.tp_grain_size)
        source = ModuleWeights(model)
        try:
            apply_plan(model, plan, tp, source, dtype, device)
        finally:
            source.close()
    else:
        model = model.to(device=device, dtype=dtype)
    return InferenceEngineV2(RaggedCausalLM(model.eval()), engine_config, tp)


def build_engine_from_ds_checkpoint(
    path: str | os.PathLike[str],
    engine_config: RaggedInferenceEngineConfig | dict[str, Any] | None = None,
    debug_level: int | None = None,
) -> InferenceEngineV2:
    """An engine from a folder written by :meth:`InferenceEngineV2.serialize`, with the
    ``tensor_parallel.tp_size`` it was saved with: each rank loads its own saved shard (no
    Hugging Face checkpoint read, no re-sharding). A DeepSpeed-written v2 checkpoint is refused
    (pickled config, CUDA-kernel layouts): build from the Hugging Face checkpoint instead."""
    if engine_config is None or isinstance(engine_config, dict):
        engine_config = RaggedInferenceEngineConfig.from_dict(engine_config or {})
    if debug_level is not None:
        logger.setLevel(debug_level)
    tp_config = engine_config.tensor_parallel
    tp = resolve_tp_group(
        DeepSpeedTPConfig(tp_size=tp_config.tp_size, tp_grain_size=tp_config.tp_grain_size)
    )
    device = torch.device(get_accelerator().current_device_name())
    model, _ = load_model(path, tp, tp_config.tp_grain_size, engine_config.dtype, device)
    return InferenceEngineV2(RaggedCausalLM(model), engine_config, tp)


def _load(path_or_model: Any, config: RaggedInferenceEngineConfig) -> nn.Module:
    if isinstance(path_or_model, nn.Module):
        return path_or_model
    if not isinstance(path_or_model, str | os.PathLike):
        raise TypeError(
            "build_hf_engine needs a local model directory or a Hugging Face model, got "
            f"{type(path_or_model).__name__}."
        )
    if not os.path.isdir(path_or_model):
        raise ValueError(
            f"build_hf_engine: {os.fspath(path_or_model)!r} is not a local directory; give the "
            "path of a saved Hugging Face model (models are not downloaded)."
        )
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"local_files_only": True}
    if config.dtype is not None:
        kwargs["dtype"] = config.dtype
    return AutoModelForCausalLM.from_pretrained(os.fspath(path_or_model), **kwargs)
