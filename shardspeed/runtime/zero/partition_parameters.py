"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: the user-facing side of ZeRO-3.

* :class:`ZeroParamStatus` — DeepSpeed's name for a parameter's state (``param.ds_status``);
  shardspeed keeps the state on the parameter's record
  (:class:`~shardspeed.runtime.zero.records.ParamState`) and maps it here.
* :func:`register_external_parameter` — tell ZeRO-3 that ``module``'s forward uses a parameter
  it does not own, so the module's forward gathers it too.
* :class:`GatheredParameters` — gather partitioned parameters for a block of code (to read,
  or, with ``modifier_rank``, to change them: that rank's values reach every rank's shards on
  exit). Parameters that are not partitioned pass through untouched, so the same code runs at
  every stage.
* :func:`zero_wrapper_for_fp_tensor_constructor` and ``_orig_torch_arange``: DeepSpeed's names
  for its tensor-constructor wrapping, which Hugging Face's ``prevent_arange_dtype_change``
  swaps out around ``zero.Init``. shardspeed's ``zero.Init`` does not wrap constructors (it
  casts parameters when it partitions them, buffers keep the dtype they were built with), so
  the swap changes nothing here; the names exist so that code runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.zero.gather_units import GatherUnit, external_parameters
from shardspeed.runtime.zero.records import record_of
from shardspeed.runtime.zero.zero_parameter import (
    ZeroParameter,
    ZeroParamStatus,
    ZeroParamType,
    param_status,
)

__all__ = [
    "GatheredParameters",
    "ZeroParamStatus",
    "ZeroParamType",
    "ZeroParameter",
    "param_status",
    "publish",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

#: ``torch.arange`` as it was when shardspeed was imported (DeepSpeed's name)
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor],
    target_fp_dtype: torch.dtype,
    target_device: torch.device | str | None = None,
) -> Callable[..., torch.Tensor]:
    """``fn`` (a tensor constructor) made to build on ``target_device`` unless a device is
    given, with floating-point results cast to ``target_fp_dtype`` (DeepSpeed's helper)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped


def _as_list(params: Any) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    # None entries are skipped, as DeepSpeed does: HF passes [weight, bias] for a Linear
    # whose bias is None
    return [p for p in params if p is not None]


def _units_of(params: Iterable[torch.Tensor]) -> list[GatherUnit]:
    units: list[GatherUnit] = []
    for param in params:
        record = record_of(param)
        unit = None if record is None else record.unit
        if unit is not None and unit not in units:
            units.append(unit)
    return units


class GatheredParameters:
    """Gather ``params`` (a parameter or an iterable of them) inside the ``with`` block.

    ``modifier_rank``: the rank whose changes to the gathered values are kept; on exit its
    values are broadcast and every rank's shards updated. ``None`` (read only): changes are
    discarded. ``fwd_module`` is accepted for DeepSpeed compatibility (external parameters are
    registered with :func:`register_external_parameter`). ``enabled=False`` does nothing.

    Every rank of the data-parallel group must enter the block with the same parameters: the
    gather is a collective. Inside the block the parameters stay gathered, also across a
    forward pass; on exit they move to a fresh (empty) storage, so a tensor the block kept of
    them (``p.detach().cpu()`` is ``p``'s own memory on a CPU device) keeps its values.
    """

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        del fwd_module
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.units = _units_of(self.params) if enabled else []
        self._released: list[GatherUnit] = []

    def __enter__(self) -> None:
        self._released = [unit for unit in self.units if not unit.gathered]
        for unit in self.units:
            unit.start_gather()
        for unit in self.units:
            unit.finish_gather()
            unit.holds += 1  # a forward inside the block leaves them gathered

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for unit in self.units:
            unit.holds -= 1
        if self.modifier_rank is not None and exc_type is None:
            publish(self.units, self.modifier_rank)
        for unit in self._released:
            unit.release()  # to a fresh storage: tensors the block's code kept stay valid


@torch.no_grad()
def publish(units: Sequence[GatherUnit], rank: int) -> None:
    """Broadcast the (gathered) full buffers of ``units`` from group rank ``rank`` and make
    every rank's shards follow them."""
    for unit in units:
        for flat in unit.flats:
            flat.comm.broadcast(flat.full, member=rank)
            flat.keep_full_values()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` (owned by another module) whenever ``module``'s forward runs.

    Call it before ``initialize`` (in the module's ``__init__``, as DeepSpeed users do) or
    after: a live stage 3 strategy picks it up at once."""
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"register_external_parameter needs a parameter, got {type(parameter)}")
    used = external_parameters(module)
    if not any(p is parameter for p in used):
        used.append(parameter)
    record = record_of(parameter)
    owner = None if record is None else record.owner
    sharding = getattr(owner, "sharding", None)
    if sharding is not None:
        sharding.use(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (the next strategy built plans without it)."""
    used = external_parameters(module)
    used[:] = [p for p in used if p is not parameter]
