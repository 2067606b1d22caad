"""DeepSpeed's ``deepspeed.runtime.precision_config``: one precision section from a config dict.

The models live in :mod:`shardspeed.config.precision`; these helpers read the section the way
DeepSpeed's do (``bf16`` or its legacy name ``bfloat16``; a missing section gives the defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.config.precision import DeepSpeedBF16Config, DeepSpeedFP16Config

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
FP16 = "fp16"

__all__ = [
    "BFLOAT16",
    "BFLOAT16_OLD",
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "FP16",
    "get_bfloat16_config",
    "get_float16_config",
]


def _section(param_dict: Mapping[str, Any], key: str) -> dict[str, Any]:
    section = param_dict.get(key)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise DeepSpeedConfigError(
            f"'{key}' must be an object such as {{\"enabled\": true}}, got {section!r}"
        )
    return dict(section)


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The ``bf16`` (or legacy ``bfloat16``) section of a DeepSpeed config dict, validated."""
    if BFLOAT16 in param_dict and BFLOAT16_OLD in param_dict:
        raise DeepSpeedConfigError(
            "both 'bf16' and its legacy name 'bfloat16' are given; keep only 'bf16'."
        )
    key = BFLOAT16 if BFLOAT16 in param_dict else BFLOAT16_OLD
    return DeepSpeedBF16Config(**_section(param_dict, key))


def get_float16_config(param_dict: Mapping[str, Any]) -> DeepSpeedFP16Config:
    """The ``fp16`` section of a DeepSpeed config dict, validated."""
    return DeepSpeedFP16Config(**_section(param_dict, FP16))
