"""One typed record per model parameter, in one registry: everything the ZeRO layer knows about
a parameter lives here, not in id-keyed maps spread over its objects nor as attributes bolted
onto the tensor.

A :class:`ParamRecord` names the parameter, says which shard group and optimizer parameter group
it belongs to, where it sits in its gradient bucket and flat buffer, which piece of it this rank
owns, which dtype its gradient is communicated in, and its :class:`ParamState`. Stages 0-2 keep
every parameter whole (``GATHERED``); stage 3 moves records through ``SHARDED -> GATHERING ->
GATHERED`` and back.

:class:`ParamRegistry` holds the records of one module (a tied parameter once, under its first
name). :func:`record_of` finds the record of any parameter a live strategy manages (the
``safe_get_*`` utilities start there); the index behind it is weak on both sides, so it keeps
neither a model nor a strategy alive.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from shardspeed.runtime.zero.buckets import GradBucket
    from shardspeed.runtime.zero.gather_units import GatherUnit
    from shardspeed.runtime.zero.partition import Piece
    from shardspeed.runtime.zero.shard_group import ShardGroup


class ParamState(enum.Enum):
    """Where a parameter's full value is: only as shards across ranks, being gathered, or whole
    on this rank (always, before stage 3)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(eq=False)
class ParamRecord:
    """What the ZeRO layer knows about one parameter."""

    name: str
    param: nn.Parameter
    #: its position in the registry (DeepSpeed's ``ds_id``)
    index: int = 0
    state: ParamState = ParamState.GATHERED
    #: the shard group that reduces (and steps) it; None if nothing trains it
    group: ShardGroup | None = field(default=None, repr=False)
    #: index of its optimizer parameter group
    opt_group: int = 0
    #: its gradient bucket, its position in the bucket and its offset in the bucket's flat layout
    bucket: GradBucket | None = field(default=None, repr=False)
    position: int = 0
    offset: int = 0
    #: this rank's piece of it (partitioned groups; None where this rank owns none of it)
    piece: Piece | None = None
    #: the separate tensor the optimizer steps for it (replicated groups with master weights)
    master: torch.Tensor | None = field(default=None, repr=False)
    #: the ZeRO-3 gather unit it lives in (None before stage 3)
    unit: GatherUnit | None = field(default=None, repr=False)
    #: dtype its gradient is communicated in
    comm_dtype: torch.dtype | None = None
    #: whether it got a gradient since the gradients were last zeroed (unused-parameter check)
    used: bool = False
    #: the reducing backward in which its gradient last arrived (a second one is an error)
    arrived_in: int = -1
    #: gather-unit indices of the modules whose forward is running with it fetched (stage 3;
    #: DeepSpeed's ``param.ds_active_sub_modules``: informational, nothing is released by it)
    active: set[int] = field(default_factory=set, repr=False)
    #: the strategy whose registry holds this record (weak)
    owner_ref: Callable[[], Any] = field(default=lambda: None, repr=False)

    @property
    def owner(self) -> Any:
        """The live strategy managing this parameter, or None."""
        return self.owner_ref()

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def trained(self) -> bool:
        return self.group is not None


# parameter -> its record, weak on both sides (see the module docstring)
_INDEX: WeakIdKeyDictionary = WeakIdKeyDictionary()


def index_record(record: ParamRecord) -> None:
    """Make :func:`record_of` find ``record`` for its parameter (a record outside any registry:
    one ``zero.Init`` made while building the module; whoever keeps it alive keeps it found)."""
    _INDEX[record.param] = weakref.ref(record)


def record_of(param: torch.Tensor) -> ParamRecord | None:
    """The record of ``param`` in the registry of the live strategy that manages it, or None."""
    ref = _INDEX.get(param)
    return None if ref is None else ref()


class ParamRegistry:
    """The records of one module's parameters, in module order (tied parameters once)."""

    def __init__(self, module: nn.Module, owner: Any) -> None:
        #: the strategy these records belong to (what ``safe_get_*`` reaches through a record)
        self._owner = weakref.ref(owner)
        self.records: list[ParamRecord] = []
        self._by_id: dict[int, ParamRecord] = {}
        for name, param in module.named_parameters():
            record = ParamRecord(name, param, len(self.records), owner_ref=self._owner)
            self.records.append(record)
            self._by_id[id(param)] = record
            _INDEX[param] = weakref.ref(record)

    @property
    def owner(self) -> Any:
        return self._owner()

    def get(self, param: torch.Tensor) -> ParamRecord | None:
        return self._by_id.get(id(param))

    def __getitem__(self, param: torch.Tensor) -> ParamRecord:
        record = self._by_id.get(id(param))
        if record is None:
            raise KeyError(f"a tensor of shape {tuple(param.shape)} is not a module parameter")
        return record

    def __contains__(self, param: object) -> bool:
        return id(param) in self._by_id

    def rename(self, module: nn.Module) -> None:
        """Re-read each parameter's name from ``module``: a wrapper inserted after the engine
        was built (random-LTD's ``convert_to_random_ltd``) moves parameters to new names."""
        for name, param in module.named_parameters():
            record = self._by_id.get(id(param))
            if record is not None:
                record.name = name

    def names(self) -> dict[int, str]:
        """Each parameter's name by ``id`` (how layouts and error messages name parameters)."""
        return {id(r.param): r.name for r in self.records}

    def trained(self) -> list[ParamRecord]:
        return [r for r in self.records if r.trained]

    def forget(self) -> None:
        """Drop this registry's entries from the index (the strategy is being destroyed)."""
        for record in self.records:
            ref = _INDEX.get(record.param)
            if ref is not None and ref() is record:
                del _INDEX[record.param]
