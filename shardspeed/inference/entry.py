"""``init_inference`` and ``default_inference_config``: the inference entry points."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from shardspeed.inference.config import DeepSpeedInferenceConfig
from shardspeed.inference.engine import InferenceEngine

__all__ = ["default_inference_config", "init_inference"]


def default_inference_config() -> dict[str, Any]:
    """Every inference config key with its default value."""
    return DeepSpeedInferenceConfig().model_dump()


def init_inference(
    model: nn.Module,
    config: str | dict[str, Any] | DeepSpeedInferenceConfig | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """Prepare ``model`` for inference and return an :class:`InferenceEngine`.

    ``config`` is a dict, a path to a JSON file, or a :class:`DeepSpeedInferenceConfig`; keyword
    arguments are merged into it. A key given in both with different values is an error.
    """
    merged = _as_dict(config)
    for key in merged.keys() & kwargs.keys():
        if merged[key] != kwargs[key]:
            raise ValueError(
                f"Conflicting argument '{key}' in 'config':{merged[key]} and kwargs:{kwargs[key]}; "
                "give it in one place only."
            )
    merged.update(kwargs)
    return InferenceEngine(model, DeepSpeedInferenceConfig(**merged))


def _as_dict(
    config: str | Path | dict[str, Any] | DeepSpeedInferenceConfig | None,
) -> dict[str, Any]:
    if isinstance(config, DeepSpeedInferenceConfig):
        return config.model_dump(exclude_unset=True) | _code_only(config)
    if isinstance(config, str | Path):
        with open(config) as handle:
            loaded = json.load(handle)
        if not isinstance(loaded, dict):
            raise ValueError(f"inference config file {config} must hold a JSON object")
        return loaded
    return dict(config or {})


def _code_only(config: DeepSpeedInferenceConfig) -> dict[str, Any]:
    """The fields a dump leaves out (process groups, policies) that were set."""
    fields = ("mpu", "ep_group", "ep_mp_group", "injection_policy", "injection_policy_tuple")
    out = {name: getattr(config, name) for name in fields if getattr(config, name) is not None}
    tp = config.tensor_parallel.model_dump(exclude_unset=True)
    tp.update(
        {
            k: getattr(config.tensor_parallel, k)
            for k in ("mpu", "tp_group")
            if getattr(config.tensor_parallel, k) is not None
        }
    )
    return out | ({"tensor_parallel": tp} if tp else {})
