"""DeepSpeed's view of a ZeRO-3 parameter: its status enum and the read-only ``ds_*`` fields.

User code and Hugging Face read ``param.ds_id``, ``ds_status``, ``ds_numel``, ``ds_shape``,
``ds_tensor`` and ``ds_persist`` (and test ``hasattr(param, "ds_id")`` to tell a partitioned
parameter); TRL clears ``ds_active_sub_modules`` around generation. shardspeed keeps every fact on the parameter's
:class:`~shardspeed.runtime.zero.records.ParamRecord`; a partitioned parameter's class becomes
:class:`ZeroParameter`, whose ``ds_*`` properties read that record. Nothing is stored on the
tensor, and the class goes back to ``nn.Parameter`` when the strategy is destroyed.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.zero.records import ParamRecord, ParamState, record_of

__all__ = ["ZeroParamStatus", "ZeroParamType", "ZeroParameter", "param_status"]


class ZeroParamType(enum.Enum):
    """DeepSpeed's parameter kinds (shardspeed's partitioned parameters are all
    ``PARTITIONED``; the name exists for code that imports it)."""

    #: an ordinary parameter
    NORMAL = 1
    #: split across the data-parallel ranks
    PARTITIONED = 2
    #: held by one rank only
    REMOTE = 3


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's parameter states."""

    #: whole on this rank
    AVAILABLE = 1
    #: only this rank's shard is held
    NOT_AVAILABLE = 2
    #: being gathered
    INFLIGHT = 3


_STATUS = {
    ParamState.GATHERED: ZeroParamStatus.AVAILABLE,
    ParamState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    ParamState.GATHERING: ZeroParamStatus.INFLIGHT,
}


def param_status(param: torch.Tensor) -> ZeroParamStatus:
    """``param``'s DeepSpeed status (AVAILABLE for any parameter ZeRO-3 does not partition)."""
    record = record_of(param)
    return ZeroParamStatus.AVAILABLE if record is None else _STATUS[record.state]


class ZeroParameter(nn.Parameter):
    """A parameter ZeRO-3 partitions (see the module docstring); behaves as ``nn.Parameter``."""

    def _record(self) -> ParamRecord:
        record = record_of(self)
        if record is None:
            raise AttributeError("this parameter is no longer managed by ZeRO-3")
        return record

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        """A whole, ordinary parameter with this one's full value (``copy.deepcopy`` of a
        module built under ``zero.Init``, e.g. the Mixture-of-Experts layer copying its expert
        once per local expert). A released parameter is gathered for the copy: a collective
        over its buffer's group, so every rank of it copies the module at the same point, as
        every rank builds it."""
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        record = record_of(self)
        unit = None if record is None else record.unit
        released = unit is not None and not unit.gathered
        if released:
            assert unit is not None
            unit.gather()
        try:
            copied = nn.Parameter(self.data.clone(), self.requires_grad)
        finally:
            if released:
                assert unit is not None
                unit.release()
        memo[id(self)] = copied
        return copied

    @property
    def ds_id(self) -> int:
        return self._record().index

    @property
    def ds_status(self) -> ZeroParamStatus:
        return param_status(self)

    @property
    def ds_numel(self) -> int:
        return self.numel()

    @property
    def ds_shape(self) -> torch.Size:
        return self.shape

    @property
    def ds_persist(self) -> bool:
        unit = self._record().unit
        return bool(unit is not None and unit.persistent)

    @property
    def ds_active_sub_modules(self) -> set[int]:
        """The modules (gather-unit indices) whose forward runs with this parameter fetched
        now; the set itself, so ``.clear()`` (TRL's ``remove_hooks``) clears it."""
        return self._record().active

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's part of the parameter (1-D; its length depends on where the parameter
        sits in its flat buffer, and may be 0)."""
        unit = self._record().unit
        assert unit is not None
        flat = next(f for f in unit.flats if f.holds(self))
        return flat.piece_of(self)

    def ds_tensor_written(self) -> None:
        """This rank's part was written (``safe_set_*``): copies made from the old values (hpZ's
        secondary shard) are dropped, so the next gather sees the new ones."""
        unit = self._record().unit
        assert unit is not None
        next(f for f in unit.flats if f.holds(self)).invalidate_secondary()


def mark_partitioned(param: nn.Parameter) -> None:
    """Give ``param`` the ``ds_*`` views (see :class:`ZeroParameter`)."""
    if type(param) is nn.Parameter:
        param.__class__ = ZeroParameter


def unmark_partitioned(param: nn.Parameter) -> None:
    if type(param) is ZeroParameter:
        param.__class__ = nn.Parameter  # type: ignore[assignment]  # the class it had
