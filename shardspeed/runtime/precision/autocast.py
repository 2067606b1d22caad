"""torch_autocast support: DeepSpeed's documented module functions and the forward context.

In torch_autocast mode parameters stay fp32 and forward runs under ``torch.autocast``. The
parameters of "lower-precision-safe" modules (``torch.nn.Linear`` and the convolutions by default)
may be communicated in the autocast dtype: the ZeRO strategy marks their records from
:func:`lower_precision_safe_params`, and :func:`get_comm_dtype` answers user code that asks.

DeepSpeed documents these as module functions, so the state they share lives in one small
module-level object, :data:`_STATE`, instead of attributes bolted onto parameters.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardspeed.runtime.precision.dtypes import parse_dtype
from shardspeed.runtime.precision.policy import DEFAULT_LOWER_PRECISION_SAFE_MODULES
from shardspeed.utils.logging import current_rank, logger

__all__ = [
    "autocast_if_enabled",
    "get_all_comm_dtypes",
    "get_autocast_dtype",
    "get_comm_dtype",
    "get_default_autocast_lower_precision_modules",
    "has_comm_dtype",
    "init_autocast_params",
    "is_autocast_initialized",
    "lower_precision_safe_params",
    "reset_autocast_state",
    "sort_dtypes",
]


@dataclass
class _AutocastState:
    initialized: bool = False
    dtype: torch.dtype | None = None
    # Weak, identity-keyed: parameters are unhashable by value and must not be kept alive here.
    comm_dtypes: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    warned_nested_disabled: bool = False
    logged_nested_override: bool = False


_STATE = _AutocastState()


def reset_autocast_state() -> None:
    """Forget everything :func:`init_autocast_params` and the forward context recorded."""
    global _STATE
    _STATE = _AutocastState()


def get_default_autocast_lower_precision_modules() -> list[str]:
    """The default ``torch_autocast.lower_precision_safe_modules``: Linear and Conv1d/2d/3d."""
    return list(DEFAULT_LOWER_PRECISION_SAFE_MODULES)


def is_autocast_initialized() -> bool:
    """Whether :func:`init_autocast_params` has run in this process."""
    return _STATE.initialized


def get_autocast_dtype() -> torch.dtype | None:
    """The dtype given to :func:`init_autocast_params` (``None`` before it ran)."""
    return _STATE.dtype


def _resolve_module_class(name: str) -> type:
    package, _, class_name = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(package), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"torch_autocast.lower_precision_safe_modules entry {name!r} cannot be imported "
            f"({err}); give a fully qualified class name such as 'torch.nn.Linear'"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(
            f"torch_autocast.lower_precision_safe_modules entry {name!r} is not an nn.Module class"
        )
    return cls


def _validate_engine(engine: Any, model: torch.nn.Module) -> None:
    for flag, section in (("fp16_enabled", "fp16"), ("bfloat16_enabled", "bf16")):
        check = getattr(engine, flag, None)
        if callable(check) and check():
            raise ValueError(
                f"torch_autocast and {section} are both enabled; set {section}.enabled=false "
                "(torch_autocast keeps fp32 parameters)"
            )
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != torch.float32:
            raise ValueError(
                f"torch_autocast needs fp32 parameters, but {name} is {param.dtype}; "
                "do not cast the model before passing it in"
            )


def init_autocast_params(
    engine: Any,
    dtype: torch.dtype,
    torch_autocast_lower_precision_safe_modules: list[str] | None,
) -> None:
    """Set up torch_autocast for ``engine``'s model.

    Records ``dtype`` as the communication dtype of every parameter owned directly by a module
    whose class is exactly one of ``torch_autocast_lower_precision_safe_modules`` (the defaults
    when ``None``). ``engine`` is anything with a ``.module`` attribute, or the model itself.
    """
    dtype = parse_dtype(dtype, "torch_autocast.dtype")
    inner = getattr(engine, "module", None)
    model = inner if isinstance(inner, torch.nn.Module) else engine
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"init_autocast_params needs an engine or nn.Module, got {type(engine)}")
    _validate_engine(engine, model)
    for param in lower_precision_safe_params(model, torch_autocast_lower_precision_safe_modules):
        _STATE.comm_dtypes[param] = dtype
    _STATE.dtype = dtype
    _STATE.initialized = True


def lower_precision_safe_params(
    model: torch.nn.Module, module_names: Iterable[str] | None
) -> list[torch.nn.Parameter]:
    """The parameters owned directly by a module whose class is exactly one of ``module_names``
    (qualified class names; the defaults when ``None``): those whose gradients may be
    communicated in the autocast dtype."""
    names = get_default_autocast_lower_precision_modules() if module_names is None else module_names
    safe_classes = {_resolve_module_class(name) for name in names}
    params: list[torch.nn.Parameter] = []
    for module in model.modules():
        # Exact class match, as DeepSpeed does: a subclass may add ops that are not safe.
        if type(module) in safe_classes:
            params.extend(module.parameters(recurse=False))
    return params


def has_comm_dtype(param: torch.Tensor) -> bool:
    """Whether ``param`` was marked lower-precision-safe by :func:`init_autocast_params`."""
    return param in _STATE.comm_dtypes


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype to communicate ``param`` (and its gradient) in: the autocast dtype if it was
    marked lower-precision-safe, else its own dtype."""
    return _STATE.comm_dtypes.get(param, param.dtype)


def get_all_comm_dtypes(params: Iterable[torch.Tensor]) -> set[torch.dtype]:
    """The set of communication dtypes over ``params``."""
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    """``dtypes`` in a fixed order, so every rank buckets them identically."""
    return sorted(dtypes, key=str)


@contextmanager
def autocast_if_enabled(
    enabled: bool,
    dtype: torch.dtype | None,
    device_type: str,
    *,
    native_low_precision: bool = True,
) -> Iterator[None]:
    """The autocast context the engine wraps ``forward`` in.

    * ``enabled`` (torch_autocast on): run under ``torch.autocast(device_type, dtype)``. If the
      caller already opened an autocast with another dtype, the config dtype wins (logged once);
      with the same dtype the outer context is reused as is.
    * not ``enabled`` with ``native_low_precision`` (fp16/bf16 sections): an outer autocast is
      switched off inside forward (warned once), since the model already runs in its dtype.
    * otherwise the caller's context is left untouched.
    """
    outer = torch.is_autocast_enabled(device_type)
    if enabled:
        if outer and torch.get_autocast_dtype(device_type) == dtype:
            yield
            return
        if outer and not _STATE.logged_nested_override:
            _STATE.logged_nested_override = True
            if current_rank() == 0:
                logger.info(
                    f"torch.autocast with dtype {torch.get_autocast_dtype(device_type)} is active "
                    f"around engine.forward(); the config's torch_autocast.dtype={dtype} "
                    "overrides it inside forward"
                )
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
    elif outer and native_low_precision:
        if not _STATE.warned_nested_disabled:
            _STATE.warned_nested_disabled = True
            if current_rank() == 0:
                logger.warning(
                    "torch.autocast is active around engine.forward(), but torch_autocast is not "
                    "enabled in the config and the model runs in native fp16/bf16, so autocast "
                    "is disabled inside forward; set torch_autocast.enabled=true to use autocast"
                )
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield
