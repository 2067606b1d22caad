"""The few data-only types a checkpoint file may name besides tensors and plain containers, and
the plain data each loads as.

Checkpoints are read with ``torch.load(weights_only=True)`` (:mod:`.reader`): a file can name
only torch's tensor types and the globals listed here, so loading it runs no code of its choosing.
DeepSpeed's own files hold objects of a few of its classes; they load without DeepSpeed
installed, through stand-ins defined here, and come out as plain data (:func:`plain`):

- its loss scalers (``LossScaler``, ``DynamicLossScaler``): a dict of their fields;
- ``ZeroStageEnum`` (the ``zero_stage`` of its optimizer shards): the int it stands for;
- ``fragment_address`` (``param_slice_mappings``): a dict ``{"numel", "start"}``;
- ``argparse.Namespace`` (the ``args`` Megatron-DeepSpeed saves): itself, a record of fields.

Standard library only: this module is part of the standalone ``zero_to_fp32.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, ClassVar


class _Fields:
    """Stands in for a data-only class of DeepSpeed: keeps what the file holds (constructor
    arguments, then the state dict set by the unpickler) and nothing else."""

    #: the names of the constructor arguments, in order (a named tuple's fields)
    fields: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, *args: Any) -> _Fields:
        obj = super().__new__(cls)
        obj.args = args
        obj.state = {}
        return obj

    args: tuple[Any, ...]
    state: dict[str, Any]

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise TypeError(f"{type(self).__name__}: expected a dict of fields, got {state!r}")
        self.state = dict(state)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (positional arguments named by :attr:`fields`)."""
        named = dict(zip(self.fields, self.args, strict=False))
        extra = self.args[len(self.fields) :]
        if extra:
            named["args"] = list(extra)
        return {**named, **self.state}


class _LossScaler(_Fields):
    """DeepSpeed's ``LossScaler`` / ``DynamicLossScaler``: their attributes (``cur_scale``, ...)."""


class _FragmentAddress(_Fields):
    """DeepSpeed's ``fragment_address`` (a named tuple in older versions, a dataclass later)."""

    fields = ("numel", "start")


def _enum_value(value: Any) -> Any:
    """DeepSpeed's enums (``ZeroStageEnum(2)``) load as their value."""
    return value


#: (stand-in, the global name a file uses for it): what ``torch.load(weights_only=True)`` accepts
#: besides tensors and plain containers
ALLOWED_GLOBALS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (argparse.Namespace, "argparse.Namespace"),
]
#: the same, by global name
STAND_INS: dict[str, Any] = {g[1]: g[0] for g in ALLOWED_GLOBALS if isinstance(g, tuple)}


def plain(obj: Any) -> Any:
    """``obj`` with every stand-in object in it (nested in dicts, lists, tuples, sets and
    namespaces) replaced by plain data; containers are updated in place where they can be."""
    if isinstance(obj, _Fields):
        return {k: plain(v) for k, v in obj.as_dict().items()}
    if isinstance(obj, dict):
        for key, value in obj.items():
            new = plain(value)
            if new is not value:
                obj[key] = new
        return obj
    if isinstance(obj, list):
        obj[:] = [plain(v) for v in obj]
        return obj
    if type(obj) is tuple:
        items = tuple(plain(v) for v in obj)
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else items
    if isinstance(obj, argparse.Namespace):
        for key, value in vars(obj).items():
            setattr(obj, key, plain(value))
        return obj
    return obj
