"""Tensor-parallel checkpoints: where each saved piece of a split parameter sits in the whole.

An AutoTP job saves one set of files per tensor-parallel rank, as DeepSpeed names them:
``mp_rank_{tp:02d}_model_states.pt`` (that rank's pieces of the module, written by the first
data-parallel rank of its group) and ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt``
(each data-parallel rank's optimizer shard of those pieces). The record of the save
(``shardspeed_plan``) carries, under :data:`TP_KEY`, the tensor-parallel size and, for every
split parameter, its whole shape, the dimension it is split along and every rank's ranges of
that dimension (:class:`TpSplit`). Several ranks may hold the same ranges (key/value heads
shared when there are fewer of them than ranks); they hold equal values, and any copy serves.

A record is untrusted input: :meth:`TpRecord.from_record` checks that the ranges lie inside the
whole tensor and tile it, and :meth:`TpSplit.check_piece` that a file's tensor has the shape the
record gives its rank. Needs only torch: this module is part of the standalone
``zero_to_fp32.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the model-states key holding the record of a save (shardspeed's; DeepSpeed ignores it)
PLAN_KEY = "shardspeed_plan"
#: the key of the record's tensor-parallel section
TP_KEY = "tensor_parallel"

Ranges = tuple[tuple[int, int], ...]


class TpLayoutError(ValueError):
    """A checkpoint's tensor-parallel record disagrees with itself or with its files."""


def _damaged(where: str, what: str) -> TpLayoutError:
    return TpLayoutError(
        f"the tensor-parallel record of {where} {what}: the record or a file of the tag was "
        "edited or comes from another save. Copy the whole tag folder of one save, or load "
        "another tag"
    )


@dataclass(frozen=True)
class TpSplit:
    """One split parameter: its whole shape, the dimension it is split along, and the ranges
    of that dimension each tensor-parallel rank holds (concatenated, in rank order)."""

    full_shape: tuple[int, ...]
    dim: int
    ranks: tuple[Ranges, ...]

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of rank ``rank``'s piece."""
        shape = list(self.full_shape)
        shape[self.dim] = sum(stop - start for start, stop in self.ranks[rank])
        return tuple(shape)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of the whole tensor ``full`` (a new tensor)."""
        parts = [full.narrow(self.dim, a, b - a) for a, b in self.ranks[rank]]
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0].clone()

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece (``parts[r]``: rank ``r``'s; a shared
        range is taken from its first holder)."""
        full = parts[0].new_empty(self.full_shape)
        done: set[tuple[int, int]] = set()
        for ranges, part in zip(self.ranks, parts, strict=True):
            offset = 0
            for start, stop in ranges:
                if (start, stop) not in done:
                    done.add((start, stop))
                    full.narrow(self.dim, start, stop - start).copy_(
                        part.narrow(self.dim, offset, stop - start)
                    )
                offset += stop - start
        return full

    def check_piece(self, name: str, rank: int, shape: tuple[int, ...], file: str) -> None:
        """Refuse ``file``'s tensor ``name`` of ``shape`` unless it is rank ``rank``'s piece as
        recorded."""
        want = self.local_shape(rank)
        if tuple(shape) != want:
            raise TpLayoutError(
                f"{file} holds {name!r} with shape {list(shape)}, but the checkpoint's "
                f"tensor-parallel record gives tensor-parallel rank {rank} a piece of shape "
                f"{list(want)} of the whole {list(self.full_shape)}: the record or the file was "
                "edited or comes from another save. Copy the whole tag folder of one save, or "
                "load another tag"
            )

    def to_record(self) -> dict[str, Any]:
        return {
            "full_shape": list(self.full_shape),
            "dim": self.dim,
            "ranks": [[list(r) for r in ranges] for ranges in self.ranks],
        }

    @classmethod
    def from_record(cls, name: str, record: Mapping[str, Any], size: int, where: str) -> TpSplit:
        """The split of ``name`` as recorded (checked: ``size`` ranks whose ranges lie inside
        the whole tensor and tile its split dimension)."""
        try:
            full = tuple(int(s) for s in record["full_shape"])
            dim = int(record["dim"])
            ranks = tuple(tuple((int(a), int(b)) for a, b in ranges) for ranges in record["ranks"])
        except (KeyError, TypeError, ValueError) as error:
            raise _damaged(where, f"is malformed for {name!r} ({error!r})") from error
        if not 0 <= dim < len(full) or len(ranks) != size or any(not r for r in ranks):
            raise _damaged(
                where,
                f"splits {name!r} (shape {list(full)}) along dimension {dim} into "
                f"{len(ranks)} pieces for {size} ranks",
            )
        extent = full[dim]
        distinct = sorted({span for ranges in ranks for span in ranges})
        reached = 0
        for start, stop in distinct:
            if start != reached or stop <= start or stop > extent:
                raise _damaged(
                    where,
                    f"gives {name!r} the ranges {distinct} of its dimension {dim}, which "
                    f"do not tile its {extent} rows exactly once",
                )
            reached = stop
        if reached != extent:
            raise _damaged(where, f"covers only {reached} of the {extent} rows of {name!r}")
        return cls(full, dim, ranks)


@dataclass(frozen=True)
class TpRecord:
    """The tensor-parallel section of a save's record: ``size`` ranks, and the split of every
    parameter that is split (the others are whole on every rank)."""

    size: int
    splits: dict[str, TpSplit]

    def to_record(self) -> dict[str, Any]:
        return {"size": self.size, "params": {k: v.to_record() for k, v in self.splits.items()}}

    @classmethod
    def from_record(cls, record: Any, where: str) -> TpRecord:
        if not isinstance(record, Mapping) or not isinstance(record.get("params"), Mapping):
            raise _damaged(where, "is malformed")
        size = record.get("size")
        if not isinstance(size, int) or size < 1:
            raise _damaged(where, f"names {size!r} tensor-parallel ranks")
        splits = {
            str(name): TpSplit.from_record(str(name), entry, size, where)
            for name, entry in record["params"].items()
        }
        return cls(size, splits)

    def shape_of(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        """The shape rank ``rank`` holds of tensor ``name`` whose whole shape is ``shape``."""
        split = self.splits.get(name)
        return shape if split is None else split.local_shape(rank)

    def check_state(self, state: Mapping[str, Any], rank: int, file: str) -> None:
        """Refuse ``file``'s module ``state`` (rank ``rank``'s) where a split tensor is not
        the piece the record gives that rank."""
        for name, split in self.splits.items():
            value = state.get(name)
            if torch.is_tensor(value):
                split.check_piece(name, rank, tuple(value.shape), file)

    def assemble_state(self, states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One whole state dict from every rank's (``states[r]``: rank ``r``'s, checked):
        split tensors assembled, the rest as rank 0 holds them; tied names stay one tensor."""
        whole: dict[str, Any] = {}
        built: dict[int, torch.Tensor] = {}
        for name, value in states[0].items():
            split = self.splits.get(name)
            if split is None or not torch.is_tensor(value):
                whole[name] = value
            elif id(value) in built:  # a tied name: the same tensor under both
                whole[name] = built[id(value)]
            else:
                parts = [state[name] for state in states]
                whole[name] = built[id(value)] = split.assemble(parts)
        return whole


def tp_record_of(model_state: Mapping[str, Any], where: str) -> TpRecord | None:
    """The tensor-parallel section of the record in ``model_state`` (a model-states file's
    content, read from ``where``), or None: saved without tensor parallelism."""
    plan = model_state.get(PLAN_KEY)
    if not isinstance(plan, Mapping) or plan.get(TP_KEY) is None:
        return None
    record = TpRecord.from_record(plan[TP_KEY], where)
    mp = model_state.get("mp_world_size", record.size)
    if mp != record.size:
        raise _damaged(where, f"names {record.size} ranks where the file's mp_world_size is {mp}")
    return record
