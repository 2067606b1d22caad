"""Choosing the process's accelerator: from the environment, by detection, or set explicitly.

``SHARDSPEED_ACCELERATOR`` (or DeepSpeed's ``DS_ACCELERATOR``) forces a backend; otherwise CUDA is
used when available, then MPS, then CPU. The choice is made once per process, on the first
:func:`get_accelerator` call, and can be replaced with :func:`set_accelerator`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from shardspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from shardspeed.accelerator.cpu_accelerator import CPU_Accelerator
from shardspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from shardspeed.accelerator.mps_accelerator import MPS_Accelerator
from shardspeed.utils.logging import logger

ENV_VARS: tuple[str, ...] = ("SHARDSPEED_ACCELERATOR", "DS_ACCELERATOR")

_FACTORIES: dict[str, Callable[[], DeepSpeedAccelerator]] = {
    "cuda": CUDA_Accelerator,
    "mps": MPS_Accelerator,
    "cpu": CPU_Accelerator,
}

SUPPORTED_ACCELERATOR_LIST: tuple[str, ...] = tuple(_FACTORIES)

# DeepSpeed accelerators that need vendor plugins shardspeed does not ship; named in the error
# so a user migrating a job sees why the value is refused rather than a bare "invalid".
_DEEPSPEED_ONLY = ("xpu", "npu", "hpu", "mlu", "sdaa", "supa")

_accelerator: DeepSpeedAccelerator | None = None


def _requested_name(env: Mapping[str, str]) -> tuple[str, str] | None:
    for var in ENV_VARS:
        value = env.get(var, "").strip()
        if value:
            return var, value
    return None


def select_accelerator(env: Mapping[str, str] | None = None) -> DeepSpeedAccelerator:
    """Build the accelerator ``env`` asks for (``os.environ`` when None), else auto-detect.

    Raises ``ValueError`` for a name shardspeed does not know, or for a device that this
    machine's torch cannot use.
    """
    env = os.environ if env is None else env
    requested = _requested_name(env)
    if requested is None:
        return _detect()
    var, value = requested
    name = value.lower()
    if name not in _FACTORIES:
        hint = (
            f" ({name!r} is a DeepSpeed plugin accelerator that shardspeed does not implement)"
            if name in _DEEPSPEED_ONLY
            else ""
        )
        raise ValueError(
            f"{var}={value!r} is not a valid accelerator{hint}; "
            f"valid values are {', '.join(SUPPORTED_ACCELERATOR_LIST)}"
        )
    accelerator = _FACTORIES[name]()
    if not accelerator.is_available():
        raise ValueError(
            f"{var}={value!r} but this torch ({torch.__version__}) cannot use {name} here "
            f"(no device, or torch was built without {name} support); "
            f"unset {var} to auto-detect or set it to 'cpu'"
        )
    return accelerator


def _detect() -> DeepSpeedAccelerator:
    if torch.cuda.is_available():
        return CUDA_Accelerator()
    if torch.backends.mps.is_available():
        return MPS_Accelerator()
    return CPU_Accelerator()


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator, chosen on first use (see the module docstring)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = select_accelerator()
        logger.debug(f"accelerator: {_accelerator!r}")
    return _accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator | None) -> None:
    """Use ``accel_obj`` from now on (None forgets the choice so the next use selects again)."""
    global _accelerator
    if accel_obj is not None and not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(
            f"set_accelerator expects a DeepSpeedAccelerator, got {type(accel_obj).__name__}"
        )
    _accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator is one shardspeed implements."""
    return get_accelerator()._name in SUPPORTED_ACCELERATOR_LIST
