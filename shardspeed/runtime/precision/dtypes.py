"""Turning the dtype spellings found in DeepSpeed configs into ``torch.dtype`` objects."""

from __future__ import annotations

import torch

# Every spelling a DeepSpeed config (or a user passing a string) is known to use.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfp16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

LOW_PRECISION_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})


def parse_dtype(value: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """Return the floating ``torch.dtype`` named by ``value`` (``"bf16"``, ``"torch.float16"``, ...).

    ``key`` names the config entry in the error message a wrong value raises.
    """
    if isinstance(value, torch.dtype):
        if value not in _DTYPE_NAMES.values():
            raise ValueError(f"{key}={value} is not supported; use one of fp32, fp16, bf16")
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
    raise ValueError(
        f"{key}={value!r} is not a known dtype; use one of {sorted(_DTYPE_NAMES)} "
        "(a 'torch.' prefix is accepted)"
    )
