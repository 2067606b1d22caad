"""Which parameters Muon steps, and the optimizer a config's ``"type": "Muon"`` builds.

DeepSpeed's rule (``set_optimizer_flags``, run by ``initialize`` when the optimizer is Muon): a
parameter gets ``use_muon = True`` when it is a matrix as a layer (two or more dimensions) and its
name, lower-cased, contains neither ``"embed"`` nor ``"lm_head"``; every other parameter
(embeddings, the LM head, norms' gains, biases) gets ``use_muon = False`` and is stepped by the
auxiliary AdamW. The flag is an attribute on the parameter because that is DeepSpeed's public
interface: a user may set it before ``initialize`` to override the rule for a parameter only by
calling the optimizer themselves (``initialize`` re-tags every parameter, as DeepSpeed does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardspeed.ops.muon.muon_optimizer import (
    ADAM_DEFAULTS,
    MUON_DEFAULTS,
    NS_PLACEMENTS,
    MuonWithAuxAdam,
    check_muon_settings,
)

MUON_OPTIMIZER = "muon"

#: names in a parameter's (lower-cased) name that keep it on AdamW: DeepSpeed's list
NOT_MUON_NAMES = ("embed", "lm_head")

#: the Muon group's keys in ``optimizer.params``; ``muon_lr`` overrides ``lr`` there
_MUON_KEYS = ("lr", "momentum", "weight_decay", "nesterov", "ns_steps", "ns_coefficients", "ns_eps")
#: the AdamW group's keys; ``adam_lr`` overrides ``lr`` there
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_VALID_KEYS = sorted({*_MUON_KEYS, *_ADAM_KEYS, "muon_lr", "adam_lr", "ns_placement"})
#: keys only the 1-bit optimizers take: a config that moved from OnebitAdam keeps them by mistake
_ONEBIT_KEYS = {
    "freeze_step",
    "cuda_aware",
    "comm_backend_name",
    "var_freeze_step",
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
    "max_coeff",
    "min_coeff",
    "coeff_beta",
    "factor_max",
    "factor_min",
    "factor_threshold",
}


def layer_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape as a layer (``ds_shape`` where ZeRO-3 reports one)."""
    shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if shape is None else tuple(shape)


def wants_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule: a matrix whose name does not mark it an embedding or the LM head."""
    lowered = name.lower()
    return len(layer_shape(param)) >= 2 and not any(word in lowered for word in NOT_MUON_NAMES)


def _optimizer_name(config: Any) -> str | None:
    name = getattr(config, "optimizer_name", None)  # DeepSpeedConfig's attribute
    if callable(name):
        name = name()
    if name is None and getattr(config, "optimizer", None) is not None:
        name = config.optimizer.type
    return name.lower() if isinstance(name, str) else None


def set_optimizer_flags(config_class: Any, model: nn.Module) -> None:
    """Tag every parameter of ``model`` with ``use_muon`` when ``config_class``'s optimizer is
    Muon (nothing otherwise): DeepSpeed's ``set_optimizer_flags``."""
    if _optimizer_name(config_class) != MUON_OPTIMIZER:
        return
    for name, param in model.named_parameters():
        param.use_muon = wants_muon(name, param)  # type: ignore[attr-defined]  # DeepSpeed's flag


def _check_keys(opt_params: dict[str, Any]) -> None:
    for key in opt_params:
        if key in _VALID_KEYS:
            continue
        why = (
            f"{key!r} is a 1-bit optimizer setting (OnebitAdam, ZeroOneAdam, OnebitLamb)"
            if key in _ONEBIT_KEYS
            else f"unknown parameter {key!r}"
        )
        raise ValueError(
            f"optimizer 'Muon': {why}; remove optimizer.params.{key}. Valid parameters: "
            f"{', '.join(_VALID_KEYS)}"
        )


def muon_param_groups(params: Iterable[Any], opt_params: dict[str, Any]) -> list[dict[str, Any]]:
    """The Muon and AdamW parameter groups for config ``optimizer.params`` over ``params``
    (tagged with ``use_muon``): DeepSpeed's split, frozen parameters left out."""
    _check_keys(opt_params)
    check_muon_settings(opt_params, "optimizer.params")
    tensors = list(params)
    if any(isinstance(p, dict) for p in tensors):
        raise TypeError(
            "optimizer 'Muon' makes its own parameter groups from each parameter's use_muon "
            "flag: pass the model's parameters to initialize(), not parameter groups"
        )
    untagged = sum(1 for p in tensors if not hasattr(p, "use_muon"))
    if untagged:
        raise ValueError(
            f"optimizer 'Muon': {untagged} parameter(s) have no use_muon flag; shardspeed."
            "initialize() tags them (set_optimizer_flags), or set param.use_muon = True/False"
        )
    muon = [p for p in tensors if p.use_muon and p.requires_grad]
    rest = [p for p in tensors if not p.use_muon and p.requires_grad]
    groups: list[dict[str, Any]] = []
    for chosen, use_muon, keys, own_lr in (
        (muon, True, _MUON_KEYS, "muon_lr"),
        (rest, False, _ADAM_KEYS, "adam_lr"),
    ):
        if not chosen:
            continue
        settings = {k: opt_params[k] for k in keys if k in opt_params}
        if own_lr in opt_params:
            settings["lr"] = opt_params[own_lr]
        groups.append({"params": chosen, "use_muon": use_muon, **settings})
    return groups


def build_muon(params: Iterable[Any], opt_params: dict[str, Any]) -> MuonWithAuxAdam:
    """``{"type": "Muon", "params": opt_params}`` over the tagged ``params``."""
    kwargs = dict(opt_params)
    placement = kwargs.pop("ns_placement", "round_robin")
    if placement not in NS_PLACEMENTS:
        raise ValueError(
            f"optimizer.params.ns_placement must be one of {', '.join(NS_PLACEMENTS)}, got "
            f"{placement!r}"
        )
    return MuonWithAuxAdam(muon_param_groups(params, kwargs), ns_placement=placement)


__all__ = [
    "ADAM_DEFAULTS",
    "MUON_DEFAULTS",
    "MUON_OPTIMIZER",
    "build_muon",
    "muon_param_groups",
    "set_optimizer_flags",
    "wants_muon",
]
