"""Reusable annotated field types: torch dtypes given by name, and "int or auto" values."""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, PlainSerializer

__all__ = [
    "DTYPE_NAMES",
    "FloatDType",
    "IntOrAuto",
    "TorchDType",
    "dtype_name",
    "parse_dtype",
    "parse_float_dtype",
]

# Every spelling DeepSpeed accepts for a dtype (its DtypeEnum), lower-cased.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "torch.float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "torch.half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "bfloat": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "torch.int8": torch.int8,
}

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def parse_dtype(value: Any, allowed: tuple[torch.dtype, ...] | None = None) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or one of its DeepSpeed names (``"bf16"``, ``"float32"``)."""
    dtype = value if isinstance(value, torch.dtype) else None
    if dtype is None and isinstance(value, str):
        dtype = DTYPE_NAMES.get(value.strip().lower())
    if dtype is None or (allowed is not None and dtype not in allowed):
        names = sorted(n for n, d in DTYPE_NAMES.items() if allowed is None or d in allowed)
        raise ValueError(f"unsupported dtype {value!r}; allowed: {', '.join(names)}")
    return dtype


def parse_float_dtype(value: Any) -> torch.dtype:
    """Like :func:`parse_dtype`, limited to fp32, fp16 and bf16."""
    return parse_dtype(value, _FLOAT_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (used when a config is dumped to JSON)."""
    return str(dtype).removeprefix("torch.")


def _int_or_auto(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f'expected an integer or "auto", got {value!r}')
    return value


_DTYPE_JSON = PlainSerializer(dtype_name, return_type=str, when_used="json")

TorchDType = Annotated[torch.dtype, BeforeValidator(parse_dtype), _DTYPE_JSON]
"""Any dtype DeepSpeed names (fp32, fp16, bf16, int8)."""

FloatDType = Annotated[torch.dtype, BeforeValidator(parse_float_dtype), _DTYPE_JSON]
"""A floating dtype: fp32, fp16 or bf16 (any DeepSpeed spelling)."""

IntOrAuto = Annotated[int | str, BeforeValidator(_int_or_auto)]
"""An integer, or the string ``"auto"`` where ``"auto"`` is a real value of the field."""
