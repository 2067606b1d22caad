"""The checkpoint planner: every file of a checkpoint described as pieces of global tensors.

Each parallelism states what a rank's files hold, tensor by tensor, as :class:`TensorPiece`\\ s:
the tensor's fully qualified name (its name in the whole, unsplit model), its global shape, and
which part of it the file holds (offsets along each dimension and the part's shape). A ZeRO
optimizer shard holds a contiguous range of a parameter's *flattened* elements, so its pieces
are ``flat``: offsets and shape are along the flattened tensor (one dimension of
``prod(global_shape)`` elements), beside the tensor's true global shape. Whole tensors (module
weights, a replicated optimizer's state, one expert's weights) are pieces at offset zero; one
expert's row of a fused ``[experts, ...]`` parameter is a piece of one row.

A rank's :class:`SavePlan` is its files and what each holds (:class:`FilePieces`). The writer
gathers every rank's holdings into one record (:func:`save_record`) stored under
:data:`PLAN_KEY` in the save's model-states file, beside DeepSpeed's keys; the files themselves
keep DeepSpeed's layout. The reader checks the record before it loads anything
(:func:`plan_load`): every tensor the loading model needs must be recorded with its global
shape, and the pieces of each tensor in each copy of the state must tile it exactly (no overlap,
no gap). A checkpoint without a record (DeepSpeed's, or shardspeed's before the record) loads
unchecked, as before (:attr:`LoadPlan.recorded` is False).

Record format (plain data, read with ``weights_only=True``)::

    {"version": 1,
     "files": [{"name": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "family": "optimizer",      # or "module": which state the pieces are of
                "copy": 0,                  # files of one copy tile each tensor together
                "pieces": {"wte.weight": {"global_shape": [64, 16], "offsets": [0],
                                          "local_shape": [512], "flat": True}, ...}}, ...],
     "tensor_parallel": {...}}      # version 2, AutoTP saves only (.tp_layout)

Tensor parallelism (version 2): a tensor-parallel rank's module file holds its piece of each
split parameter at its offsets along the split dimension (a piece of several ranges is a list
of records under its name); its optimizer shards hold flat ranges of that *piece*, recorded
with ``"tp_rank": t`` and the piece's shape as ``global_shape`` (each rank's pieces tile its own
piece); the ``tensor_parallel`` section (:class:`~shardspeed.checkpoint.tp_layout.TpRecord`)
says where each rank's piece sits in the whole tensor.

Needs only torch and the standard library (layer 2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspeed.checkpoint.tp_layout import PLAN_KEY, TP_KEY, TpRecord

#: the record structure this shardspeed writes and reads (2: with a tensor-parallel section;
#: a save without one is still written as version 1)
PLAN_VERSION = 2
#: the families of state a file's pieces are of
MODULE = "module"
OPTIMIZER = "optimizer"
FAMILIES = (MODULE, OPTIMIZER)

Shape = tuple[int, ...]


class CheckpointPlanError(ValueError):
    """A checkpoint's record disagrees with the model or with itself; it is not loaded."""


@dataclass(frozen=True)
class TensorPiece:
    """The part of global tensor ``fqn`` (shape ``global_shape``) that one file holds:
    ``local_shape`` elements from ``offsets`` along each dimension. ``flat``: offsets and shape
    are along the flattened tensor (one dimension of ``prod(global_shape)`` elements)."""

    fqn: str
    global_shape: Shape
    offsets: Shape
    local_shape: Shape
    flat: bool = False
    #: the tensor-parallel rank whose piece of the tensor ``global_shape`` is (an AutoTP
    #: optimizer shard's pieces); None: of the whole tensor
    part: int | None = None

    @classmethod
    def whole(cls, fqn: str, shape: Sequence[int]) -> TensorPiece:
        """All of tensor ``fqn`` of ``shape``."""
        shape = tuple(int(s) for s in shape)
        return cls(fqn, shape, (0,) * len(shape), shape)

    @classmethod
    def flat_range(cls, fqn: str, shape: Sequence[int], start: int, numel: int) -> TensorPiece:
        """Elements ``[start, start + numel)`` of tensor ``fqn`` (of ``shape``) flattened; all of
        it is recorded as :meth:`whole`."""
        shape = tuple(int(s) for s in shape)
        if start == 0 and numel == math.prod(shape):
            return cls.whole(fqn, shape)
        return cls(fqn, shape, (int(start),), (int(numel),), flat=True)

    @property
    def extent(self) -> Shape:
        """The shape the offsets index: the global shape, or the flattened one."""
        return (math.prod(self.global_shape),) if self.flat else self.global_shape

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def box(self) -> tuple[Shape, Shape]:
        """(first, end) along each dimension of :attr:`extent`."""
        return self.offsets, tuple(
            o + s for o, s in zip(self.offsets, self.local_shape, strict=True)
        )

    def flat_ranges(self) -> list[tuple[int, int]]:
        """The piece as ranges ``[start, stop)`` of the flattened tensor (row-major)."""
        extent = self.extent
        if not extent:
            return [(0, 1)]
        inner = math.prod(extent[1:])
        if len(extent) == 1 or self.local_shape[1:] == extent[1:]:  # contiguous rows
            start = self.offsets[0] * inner
            return [(start, start + self.local_shape[0] * inner)]
        sub = TensorPiece(self.fqn, extent[1:], self.offsets[1:], self.local_shape[1:])
        return [
            (row * inner + a, row * inner + b)
            for row in range(self.offsets[0], self.offsets[0] + self.local_shape[0])
            for a, b in sub.flat_ranges()
        ]

    def describe(self) -> str:
        if self.flat:
            first = self.offsets[0]
            return f"flattened elements [{first}, {first + self.local_shape[0]})"
        if self.offsets == (0,) * len(self.offsets) and self.local_shape == self.global_shape:
            return "the whole tensor"
        return f"offsets {list(self.offsets)}, shape {list(self.local_shape)}"

    def to_record(self) -> dict[str, Any]:
        record = {
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "local_shape": list(self.local_shape),
            "flat": self.flat,
        }
        return record if self.part is None else {**record, "tp_rank": self.part}

    @classmethod
    def from_record(cls, fqn: str, record: Mapping[str, Any]) -> TensorPiece:
        part = record.get("tp_rank")
        return cls(
            fqn,
            tuple(int(s) for s in record["global_shape"]),
            tuple(int(s) for s in record["offsets"]),
            tuple(int(s) for s in record["local_shape"]),
            bool(record.get("flat", False)),
            None if part is None else int(part),
        )

    def of_part(self, part: int) -> TensorPiece:
        """This piece as one of tensor-parallel rank ``part``'s piece of the tensor."""
        return TensorPiece(
            self.fqn, self.global_shape, self.offsets, self.local_shape, self.flat, part
        )


@dataclass(frozen=True)
class FilePieces:
    """What file ``name`` of a tag holds of the ``family`` state (module weights or optimizer
    state); the files of one ``copy`` together hold each of their tensors exactly once (a
    pipeline's stages each keep a copy of a tied weight)."""

    name: str
    family: str
    pieces: tuple[TensorPiece, ...]
    copy: int = 0

    def to_record(self) -> dict[str, Any]:
        by_fqn: dict[str, list[dict[str, Any]]] = {}
        for piece in self.pieces:
            by_fqn.setdefault(piece.fqn, []).append(piece.to_record())
        return {
            "name": self.name,
            "family": self.family,
            "copy": self.copy,
            # a tensor-parallel piece of several ranges is several pieces of its tensor
            "pieces": {k: v[0] if len(v) == 1 else v for k, v in by_fqn.items()},
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> FilePieces:
        pieces = tuple(
            TensorPiece.from_record(k, one)
            for k, v in record["pieces"].items()
            for one in (v if isinstance(v, list) else [v])
        )
        return cls(str(record["name"]), str(record["family"]), pieces, int(record.get("copy", 0)))


@dataclass
class SavePlan:
    """One rank's part of a save: its files (name -> content), what each holds, and which of
    them (if any) carries the record of the whole save."""

    files: dict[str, Any]
    holdings: list[FilePieces] = field(default_factory=list)
    record_file: str | None = None
    #: the tensor-parallel section of the record (AutoTP saves)
    tensor_parallel: TpRecord | None = None

    def hold(self, name: str, family: str, pieces: Iterable[TensorPiece], copy: int = 0) -> None:
        """Record that file ``name`` holds ``pieces`` of the ``family`` state."""
        pieces = tuple(pieces)
        if pieces:
            self.holdings.append(FilePieces(name, family, pieces, copy))


# -- what a state holds -----------------------------------------------------------------------
def whole_pieces(state: Mapping[str, Any], prefix: str = "") -> list[TensorPiece]:
    """Every tensor of ``state`` (a ``state_dict``) whole, named ``prefix + key``."""
    return [
        TensorPiece.whole(prefix + key, value.shape)
        for key, value in state.items()
        if torch.is_tensor(value)
    ]


def layout_pieces(
    layout: Sequence[Mapping[str, Any]], world: int, rank: int, shapes: Mapping[str, Sequence[int]]
) -> list[TensorPiece]:
    """The pieces of rank ``rank``'s chunk of each flat bucket of ``layout`` (a ZeRO bucket
    layout split into ``world`` equal chunks; :mod:`.layout`): each parameter's overlap with
    it, a range of the parameter's flattened elements (its shape from ``shapes``)."""
    pieces = []
    for bucket in layout:
        chunk = int(bucket["size"]) // world
        first, last = chunk * rank, chunk * (rank + 1)
        for name, offset, numel in bucket["params"]:
            start, stop = max(offset, first), min(offset + numel, last)
            if start < stop:
                pieces.append(
                    TensorPiece.flat_range(name, shapes[name], start - offset, stop - start)
                )
    return pieces


# -- the record -------------------------------------------------------------------------------
def save_record(
    holdings: Iterable[Iterable[FilePieces]], tensor_parallel: TpRecord | None = None
) -> dict[str, Any]:
    """The record of a save from every rank's holdings (plain data, for :data:`PLAN_KEY`),
    with the tensor-parallel section of an AutoTP save."""
    files = [f.to_record() for rank in holdings for f in rank]
    if tensor_parallel is None:
        return {"version": 1, "files": files}
    return {"version": PLAN_VERSION, "files": files, TP_KEY: tensor_parallel.to_record()}


def read_record(state: Mapping[str, Any], where: str) -> list[FilePieces] | None:
    """The holdings recorded in ``state`` (a model-states file's content, read from ``where``),
    or None for a checkpoint written without a record."""
    record = state.get(PLAN_KEY)
    if record is None:
        return None
    version = record.get("version") if isinstance(record, Mapping) else None
    if not isinstance(version, int) or version > PLAN_VERSION:
        raise CheckpointPlanError(
            f"{where} holds a checkpoint record of version {version!r}; this shardspeed reads "
            f"versions up to {PLAN_VERSION}. Upgrade shardspeed (pip install -U shardspeed)"
        )
    try:
        return [FilePieces.from_record(f) for f in record["files"]]
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointPlanError(
            f"the checkpoint record ({PLAN_KEY!r}) in {where} is malformed ({error!r}); the "
            "file was edited or damaged: copy the tag again, or load another tag"
        ) from error


@dataclass(frozen=True)
class LoadPlan:
    """What a load reads, checked against the model before anything is loaded: ``expected``
    (family -> name -> global shape) is what this rank's model needs from the checkpoint,
    ``sources`` the recorded files that hold each of those tensors. ``recorded`` is False for a
    checkpoint without a record (DeepSpeed's, or shardspeed's before it): nothing was checked."""

    folder: str
    recorded: bool
    expected: Mapping[str, Mapping[str, Shape]]
    sources: Mapping[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    record_file: str | None = None


def plan_load(
    folder: str,
    record_file: str,
    holdings: list[FilePieces] | None,
    expected: Mapping[str, Mapping[str, Sequence[int]]],
    tensor_parallel: TpRecord | None = None,
) -> LoadPlan:
    """The plan of loading the checkpoint in ``folder`` whose record (read from
    ``record_file``) lists ``holdings``, into a model needing ``expected``. Raises
    :class:`CheckpointPlanError` naming the tensor, the file and the fix when a piece falls
    outside its tensor, a tensor is recorded with two shapes, a tensor this model needs is
    recorded with another shape, or a tensor's pieces overlap or leave a gap; with
    ``tensor_parallel`` (the save's section) also a tensor-parallel rank's optimizer pieces
    recorded for a piece of another shape than the section gives that rank."""
    wanted = {
        family: {name: tuple(int(s) for s in shape) for name, shape in names.items()}
        for family, names in expected.items()
    }
    if holdings is None:
        return LoadPlan(folder, False, wanted)
    where = f"{folder}/{record_file}"
    by_tensor: dict[tuple[str, str, int, int | None], list[tuple[str, TensorPiece]]] = {}
    shapes: dict[tuple[str, int | None], tuple[Shape, str]] = {}
    for held in holdings:
        if held.family not in FAMILIES:
            raise CheckpointPlanError(
                f"the checkpoint record in {where} lists {held.name} with an unknown state "
                f"family {held.family!r}; the record was edited or damaged: copy the tag again"
            )
        for piece in held.pieces:
            _check_bounds(piece, held.name, where)
            first = shapes.setdefault((piece.fqn, piece.part), (piece.global_shape, held.name))
            if first[0] != piece.global_shape:
                raise CheckpointPlanError(
                    f"tensor {piece.fqn!r} is recorded with global shape {list(first[0])} in "
                    f"{first[1]} and {list(piece.global_shape)} in {held.name} (record in "
                    f"{where}): the files come from different saves; copy the whole tag folder "
                    "of one save, or load another tag"
                )
            key = (held.family, piece.fqn, held.copy, piece.part)
            by_tensor.setdefault(key, []).append((held.name, piece))
    for names in wanted.values():
        for name, shape in names.items():
            recorded = shapes.get((name, None))
            if recorded is not None and recorded[0] != shape:
                raise CheckpointPlanError(
                    f"tensor {name!r} is saved in {folder}/{recorded[1]} with global shape "
                    f"{list(recorded[0])} (recorded in {where}), but this model's {name!r} has "
                    f"shape {list(shape)}: the checkpoint is of another model. Load a "
                    "checkpoint saved from this model, or build the model with the saved shape"
                )
    if tensor_parallel is not None:
        _check_parts(shapes, tensor_parallel, where)
    for (family, fqn, copy, _), pieces in by_tensor.items():
        _check_tiling(family, fqn, copy, pieces, where)
    sources: dict[tuple[str, str], set[str]] = {}
    for (family, fqn, _, _), pieces in by_tensor.items():
        if fqn in wanted.get(family, {}):
            sources.setdefault((family, fqn), set()).update(name for name, _ in pieces)
    found = {key: tuple(sorted(names)) for key, names in sources.items()}
    return LoadPlan(folder, True, wanted, found, record_file)


def _check_parts(
    shapes: Mapping[tuple[str, int | None], tuple[Shape, str]], tp: TpRecord, where: str
) -> None:
    """Each tensor-parallel rank's pieces are recorded with the shape the record's
    tensor-parallel section gives that rank of the whole tensor."""
    for (fqn, part), (shape, file) in shapes.items():
        whole = shapes.get((fqn, None))
        if part is None or whole is None:
            continue
        if part >= tp.size or shape != tp.shape_of(fqn, whole[0], part):
            raise CheckpointPlanError(
                f"{file} is recorded to hold state of tensor-parallel rank {part}'s piece of "
                f"{fqn!r} with shape {list(shape)}, but the record's tensor-parallel section "
                f"({tp.size} ranks) gives that rank a piece of shape "
                f"{list(tp.shape_of(fqn, whole[0], part)) if part < tp.size else '-'} of the "
                f"whole {list(whole[0])} (record in {where}); the record was edited or damaged. "
                "Copy the whole tag folder of one save, or load another tag"
            )


def _check_bounds(piece: TensorPiece, file: str, where: str) -> None:
    extent = piece.extent
    first, end = piece.box()
    if (
        len(piece.offsets) != len(extent)
        or len(piece.local_shape) != len(extent)
        or any(o < 0 for o in first)
        or any(e > x for e, x in zip(end, extent, strict=True))
    ):
        raise CheckpointPlanError(
            f"tensor {piece.fqn!r} of global shape {list(piece.global_shape)} is recorded in "
            f"{file} with {piece.describe()}, which lies outside it (record in {where}): the "
            "record was edited or damaged; copy the tag again, or load another tag"
        )


def _check_tiling(
    family: str, fqn: str, copy: int, held: list[tuple[str, TensorPiece]], where: str
) -> None:
    """The pieces of one copy of a tensor (or of one tensor-parallel rank's piece of it) cover
    every element once (the same piece in two files is one piece kept twice)."""
    unique: dict[TensorPiece, str] = {}
    for name, piece in held:
        unique.setdefault(piece, name)
    total = math.prod(held[0][1].global_shape)
    part = held[0][1].part
    what = f"the {family} state of tensor {fqn!r}" + (f" (copy {copy})" if copy else "")
    what += "" if part is None else f" (tensor-parallel rank {part}'s piece)"
    if any(p.flat for p in unique):  # ranges of the flattened tensor (ZeRO shards)
        _check_ranges(what, unique, total, held, where)
        return
    # boxes along each dimension (whole tensors, expert rows, tensor-parallel slices)
    boxes = list(unique.items())
    for i, (piece, name) in enumerate(boxes):
        for other, other_name in boxes[i + 1 :]:
            if _intersect(piece, other):
                raise _overlap(what, (name, piece), (other_name, other), where)
    covered = sum(p.numel for p in unique)
    if covered != total:
        raise CheckpointPlanError(
            f"{what} has a gap: its pieces cover {covered} of its {total} elements "
            f"({sorted(set(unique.values()))[:4]}; record in {where}); a file of the save is "
            "missing from the record or the record was edited. Copy the whole tag folder of "
            "one save, or load another tag"
        )


def _check_ranges(
    what: str,
    unique: Mapping[TensorPiece, str],
    total: int,
    held: list[tuple[str, TensorPiece]],
    where: str,
) -> None:
    ranges = sorted(
        (start, stop, name, piece)
        for piece, name in unique.items()
        for start, stop in piece.flat_ranges()
    )
    reached, last = 0, None
    for start, stop, name, piece in ranges:
        if start < reached:
            assert last is not None
            raise _overlap(what, last, (name, piece), where)
        if start > reached:
            raise _gap(what, reached, start, total, held, where)
        reached, last = stop, (name, piece)
    if reached < total:
        raise _gap(what, reached, total, total, held, where)


def _intersect(a: TensorPiece, b: TensorPiece) -> bool:
    (a_first, a_end), (b_first, b_end) = a.box(), b.box()
    return all(
        max(x0, y0) < min(x1, y1)
        for x0, x1, y0, y1 in zip(a_first, a_end, b_first, b_end, strict=True)
    )


def _overlap(
    what: str, one: tuple[str, TensorPiece], two: tuple[str, TensorPiece], where: str
) -> CheckpointPlanError:
    return CheckpointPlanError(
        f"{what} is recorded twice over: {one[0]} holds {one[1].describe()} and {two[0]} holds "
        f"{two[1].describe()}, which overlap (record in {where}); the files come from different "
        "saves or the record was edited. Copy the whole tag folder of one save, or load "
        "another tag"
    )


def _gap(
    what: str, start: int, stop: int, total: int, held: list[tuple[str, TensorPiece]], where: str
) -> CheckpointPlanError:
    files = sorted({name for name, _ in held})
    return CheckpointPlanError(
        f"{what} has a gap: flattened elements [{start}, {stop}) of its {total} are in no file "
        f"(recorded in {files[:4]}; record in {where}); a shard of the save is missing from the "
        "record or the record was edited. Copy the whole tag folder of one save, or load "
        "another tag"
    )
