"""The batch triangle: ``train_batch_size = micro_batch * grad_accum * data-parallel size``.

The derivation follows DeepSpeed 0.19.2 exactly, including its floor divisions, so a config that
works (or fails) there works (or fails) here. Missing values are derived in this order:

======================  =========================================================
given                   derived
======================  =========================================================
all three               nothing (only checked)
train + micro           ``gas = train // micro // world``
train + gas             ``micro = train // world // gas``
micro + gas             ``train = micro * gas * world``
train only              ``gas = 1``, ``micro = train // world``
micro only              ``gas = 1``, ``train = micro * world``
gas only / none         error
======================  =========================================================

Afterwards all three must be positive and the equation must hold exactly; because of the floor
divisions a non-divisible pair (e.g. train 10, micro 3, world 1 -> gas 3 -> 9 != 10) is an error.
"""

from __future__ import annotations

from shardspeed.config.errors import DeepSpeedConfigError

__all__ = ["BatchSizeError", "solve_batch_triangle"]


class BatchSizeError(DeepSpeedConfigError, AssertionError):
    """Batch sizes that cannot be made consistent. Also an ``AssertionError``: DeepSpeed asserts
    the batch triangle, and its callers (and tests) catch ``AssertionError``."""


_TB = "train_batch_size"
_MB = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"


def solve_batch_triangle(
    train_batch_size: int | None,
    micro_batch: int | None,
    grad_accum: int | None,
    dp_world_size: int,
) -> tuple[int, int, int]:
    """Derive and check ``(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps)``.

    ``None`` means "not given". Raises :class:`DeepSpeedConfigError` naming all three numbers
    and the data-parallel world size, with a fix, when the values cannot be made consistent
    (a :class:`BatchSizeError`, which is also an ``AssertionError`` as in DeepSpeed).
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise DeepSpeedConfigError(
            f"the data-parallel world size must be a positive integer, got {dp_world_size!r}"
        )
    for name, value in ((_TB, train_batch_size), (_MB, micro_batch), (_GAS, grad_accum)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise DeepSpeedConfigError(f"'{name}' must be an integer, got {value!r}")

    tb, mb, gas = train_batch_size, micro_batch, grad_accum
    ws = dp_world_size
    derived = ""
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // ws if mb > 0 else 0
        derived = f"{_GAS} was derived as {tb} // {mb} // {ws} = {gas}"
    elif tb is not None and gas is not None:
        mb = tb // ws // gas if gas > 0 else 0
        derived = f"{_MB} was derived as {tb} // {ws} // {gas} = {mb}"
    elif mb is not None and gas is not None:
        tb = mb * gas * ws
        derived = f"{_TB} was derived as {mb} * {gas} * {ws} = {tb}"
    elif tb is not None:
        gas, mb = 1, tb // ws
        derived = f"{_GAS} defaulted to 1 and {_MB} was derived as {tb} // {ws} = {mb}"
    elif mb is not None:
        tb, gas = mb * ws, 1
        derived = f"{_GAS} defaulted to 1 and {_TB} was derived as {mb} * {ws} = {tb}"
    else:
        given = f" (only {_GAS}={gas} was given)" if gas is not None else ""
        raise BatchSizeError(
            f"Either {_TB} or {_MB} needs to be provided{given}; with a data-parallel world size "
            f"of {ws}, set {_MB} (and optionally {_GAS}) and {_TB} is derived."
        )

    assert tb is not None and mb is not None and gas is not None  # every branch set them
    if tb > 0 and mb > 0 and gas > 0 and tb == mb * gas * ws:
        return tb, mb, gas
    raise BatchSizeError(_mismatch_message(tb, mb, gas, ws, derived))


def _mismatch_message(tb: int, mb: int, gas: int, ws: int, derived: str) -> str:
    lines = [
        f"Batch sizes are inconsistent: {_TB} ({tb}) must equal {_MB} ({mb}) * {_GAS} ({gas}) "
        f"* data-parallel world size ({ws}) = {mb * gas * ws}, and all must be > 0."
    ]
    if derived:
        lines.append(f"Note: {derived} (DeepSpeed derives missing values with floor division).")
    if mb <= 0 or gas <= 0:
        lines.append(
            f"Fix: make {_TB} at least {_MB} * world size ({max(mb, 1) * ws}) and a multiple of "
            f"it, or give {_MB} and {_GAS} and let {_TB} be derived."
        )
    elif derived:
        lines.append(
            f"Fix: choose values that divide exactly, e.g. set {_TB} to {mb * gas * ws} "
            f"(a multiple of {_MB} * world size = {mb * ws})."
        )
    else:
        lines.append(
            f"Fix: set {_TB} to {mb * gas * ws}, or leave one of the three out so it is derived."
        )
    return " ".join(lines)
