"""Read the ``compression_training`` section from a DeepSpeed config (a dict or a JSON path)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from shardspeed.config.compression import TECHNIQUES, CompressionTrainingConfig
from shardspeed.config.errors import DeepSpeedConfigError

__all__ = ["CompressionConfigError", "TECHNIQUES", "get_compression_config"]


class CompressionConfigError(DeepSpeedConfigError, AssertionError):
    """A ``compression_training`` section that cannot be used. Also an ``AssertionError``:
    DeepSpeed asserts these conditions, and its callers catch ``AssertionError``."""


def _load(deepspeed_config: Any) -> Mapping[str, Any]:
    if isinstance(deepspeed_config, Mapping):
        return deepspeed_config
    if isinstance(deepspeed_config, str | os.PathLike) and os.path.exists(deepspeed_config):
        with open(deepspeed_config) as handle:
            loaded: dict[str, Any] = json.load(handle)
        return loaded
    raise ValueError(
        "deepspeed_config must be a dict or the path of an existing DeepSpeed JSON config; "
        f"got {deepspeed_config!r}"
    )


def get_compression_config(deepspeed_config: Any) -> CompressionTrainingConfig:
    """The validated ``compression_training`` section (every technique off when absent).

    ``deepspeed_config`` is a DeepSpeed config dict, a path to one, or an already validated
    :class:`CompressionTrainingConfig`."""
    if isinstance(deepspeed_config, CompressionTrainingConfig):
        return deepspeed_config
    section = _load(deepspeed_config).get("compression_training") or {}
    if isinstance(section, CompressionTrainingConfig):
        return section
    try:
        return CompressionTrainingConfig.from_dict(section)
    except DeepSpeedConfigError as exc:
        raise CompressionConfigError(str(exc)) from None
