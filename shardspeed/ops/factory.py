"""Build the optimizer that a DeepSpeed config's ``optimizer`` section names.

DeepSpeed's own types are matched case-insensitively (``"Adam"``, ``"adamw"``, ``"LAMB"``, ...);
any other name is looked up in ``torch.optim``, also case-insensitively (``"SGD"``, ``"rmsprop"``).
Mistakes raise ``ValueError`` naming the optimizer, the bad name and the closest valid one.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad
from shardspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardspeed.ops.lamb import FusedLamb
from shardspeed.ops.lion import DeepSpeedCPULion, FusedLion
from shardspeed.ops.muon.tagging import build_muon
from shardspeed.runtime.fp16.onebit.adam import OnebitAdam
from shardspeed.runtime.fp16.onebit.lamb import OnebitLamb
from shardspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

# config keys that select the Adam flavour rather than being constructor arguments
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
]

_NOT_YET_SUPPORTED = {
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
}


#: DeepSpeed's 1-bit optimizers (ZeRO stage 0; checked at initialize)
_ONEBIT: dict[str, Callable[..., Any]] = {
    ONEBIT_ADAM_OPTIMIZER: OnebitAdam,
    ZERO_ONE_ADAM_OPTIMIZER: ZeroOneAdam,
    ONEBIT_LAMB_OPTIMIZER: OnebitLamb,
}


def torch_optimizer_names() -> dict[str, str]:
    """Lower-cased name -> class name of every optimizer class that ``torch.optim`` exports."""
    names = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        is_optimizer = inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
        if is_optimizer and obj is not torch.optim.Optimizer:
            names[name.lower()] = name
    return names


def valid_optimizer_names() -> list[str]:
    """Every ``optimizer.type`` that :func:`build_optimizer` accepts (DeepSpeed's, then torch's)."""
    supported = [n for n in DEEPSPEED_OPTIMIZERS if n not in _NOT_YET_SUPPORTED]
    # DeepSpeed's names shadow torch's (e.g. torch.optim.Muon is not reachable as "muon")
    shadowed = set(DEEPSPEED_OPTIMIZERS)
    extra = [cls for low, cls in sorted(torch_optimizer_names().items()) if low not in shadowed]
    return supported + extra


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name`` (case-insensitive), or None when nothing is close."""
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.5)
    return by_lower[match[0]] if match else None


def check_kwargs(owner: str, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``kwargs`` holds a name ``target``'s signature does not take.

    ``owner`` names the thing in the message (e.g. ``optimizer 'FusedAdam'``). The first
    positional parameter (params / optimizer) is not a valid config key and is left out.
    """
    parameters = list(inspect.signature(target).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    valid = [
        p.name
        for p in parameters[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for key in kwargs:
        if key not in valid:
            hint = closest(key, valid)
            did_you_mean = f" Did you mean {hint!r}?" if hint else ""
            raise ValueError(
                f"{owner} got an unknown parameter {key!r}.{did_you_mean} "
                f"Valid parameters: {', '.join(valid)}"
            )


def _construct(cls: Callable[..., Any], params: Any, kwargs: dict[str, Any]) -> Any:
    name = getattr(cls, "__name__", str(cls))
    check_kwargs(f"optimizer {name!r}", cls, kwargs)
    return cls(params, **kwargs)


def _build_adam(
    name: str, params: Any, opt_params: dict[str, Any], cpu_offload: bool
) -> torch.optim.Optimizer:
    torch_adam = bool(opt_params.pop(TORCH_ADAM_PARAM, False))
    adam_w_mode = bool(opt_params.pop(ADAM_W_MODE, ADAM_W_MODE_DEFAULT))
    # DeepSpeed: type "AdamW" is always AdamW; type "Adam" is AdamW too unless adam_w_mode=false
    adam_w_mode = name == ADAMW_OPTIMIZER or adam_w_mode
    if torch_adam:
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        return _construct(cls, params, opt_params)
    if cpu_offload:
        check_kwargs("optimizer 'DeepSpeedCPUAdam'", DeepSpeedCPUAdam, opt_params)
        return DeepSpeedCPUAdam(params, **opt_params, adamw_mode=adam_w_mode)
    check_kwargs("optimizer 'FusedAdam'", FusedAdam, opt_params)
    return FusedAdam(params, **opt_params, adam_w_mode=adam_w_mode)


def build_optimizer(
    name: str,
    params: Any,
    opt_params: dict[str, Any] | None = None,
    *,
    cpu_offload: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer for config ``{"type": name, "params": opt_params}`` over ``params``.

    DeepSpeed's types: ``adam`` (FusedAdam; AdamW unless ``adam_w_mode: false``; with
    ``torch_adam: true``, ``torch.optim.AdamW``/``Adam``), ``adamw`` (always AdamW), ``lamb``
    (FusedLamb), ``lion`` (FusedLion), ``adagrad`` (``torch.optim.Adagrad``), ``onebitadam``,
    ``zerooneadam``, ``onebitlamb`` (the 1-bit optimizers, ZeRO stage 0), ``muon``
    (:class:`~shardspeed.ops.muon.MuonWithAuxAdam` over parameters tagged ``use_muon``; the
    same optimizer under ZeRO-Offload, its collectives moved to the device). With
    ``cpu_offload=True`` (ZeRO-Offload) Adam, Lion and Adagrad use DeepSpeedCPUAdam,
    DeepSpeedCPULion and DeepSpeedCPUAdagrad. Any other name is a ``torch.optim`` class.
    ``opt_params`` is not modified.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"optimizer type must be a non-empty string, got {name!r}")
    kwargs = dict(opt_params or {})
    if "max_grad_norm" in kwargs:
        # DeepSpeed refuses this too: clipping belongs to the engine, which knows the global norm
        raise ValueError(
            f"optimizer {name!r}: 'max_grad_norm' is not supported as an optimizer parameter; "
            "use the top-level config key 'gradient_clipping' instead"
        )
    low = name.lower()
    if low in _NOT_YET_SUPPORTED:
        raise ValueError(
            f"optimizer type {name!r} is not yet supported in shardspeed; supported types: "
            f"{', '.join(valid_optimizer_names())}"
        )
    if low in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        return _build_adam(low, params, kwargs, cpu_offload)
    if low == LAMB_OPTIMIZER:
        return _construct(FusedLamb, params, kwargs)
    if low in _ONEBIT:
        return _construct(_ONEBIT[low], params, kwargs)
    if low == MUON_OPTIMIZER:
        return build_muon(params, kwargs)
    if low == LION_OPTIMIZER:
        return _construct(DeepSpeedCPULion if cpu_offload else FusedLion, params, kwargs)
    if low == ADAGRAD_OPTIMIZER:
        cls = DeepSpeedCPUAdagrad if cpu_offload else torch.optim.Adagrad
        return _construct(cls, params, kwargs)
    torch_names = torch_optimizer_names()
    if low in torch_names:
        return _construct(getattr(torch.optim, torch_names[low]), params, kwargs)
    hint = closest(name, valid_optimizer_names())
    did_you_mean = f" Did you mean {hint!r}?" if hint else ""
    raise ValueError(
        f"unknown optimizer type {name!r}.{did_you_mean} Valid types (case-insensitive): "
        f"{', '.join(valid_optimizer_names())}"
    )
