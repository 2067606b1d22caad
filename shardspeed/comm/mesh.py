"""A rank mesh with named axes, and the one registry that makes process groups.

A :class:`Mesh` is a table of global ranks (an integer tensor, one dimension per named axis,
as ``torch.distributed.device_mesh.DeviceMesh`` keeps it). The group "along" some axes is the
set of ranks that differ only in those axes' coordinates; :meth:`Mesh.group` returns this
rank's. A mesh can be re-viewed with other axes over the same ranks (:meth:`Mesh.reshape`:
merging adjacent axes or splitting one, in row-major order), which is how the expert-parallel
and MiCS layouts are carved out of the data-parallel axis.

Process groups: torch requires every rank to call ``new_group`` for every group, members or
not, in the same order. Every group shardspeed uses is made by :func:`groups_for` (this
module's :class:`GroupRegistry` for the live world): given every group of a partition of the
ranks, it makes the ones not made yet, in the given order, and returns this rank's. Since every
rank asks for the same partitions in the same order, every rank's registry holds the same rank
sets and the calls stay matched; asking twice for the same ranks (from two meshes, or two
engines) reuses the group. Groups made elsewhere (a Megatron ``mpu``) are :meth:`adopted
<GroupRegistry.adopt>` the same way, a whole partition at once. A group spanning the world is
the world group (None).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardspeed.comm.group_caches import register_group_cache
from shardspeed.comm.state import get_rank, get_world_group, get_world_size, is_initialized
from shardspeed.comm.state import new_group as _new_group

__all__ = ["GroupRegistry", "Mesh", "group_registry", "groups_for"]

#: registry entry for a group this rank is not a member of
_NOT_MEMBER = object()


class GroupRegistry:
    """The process groups of one world, by their sorted global ranks."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size = world_size
        self.rank = rank
        self._groups: dict[tuple[int, ...], Any] = {}

    def _check_partition(self, rank_lists: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        keys = [tuple(sorted(int(r) for r in ranks)) for ranks in rank_lists]
        seen: set[int] = set()
        for key in keys:
            if not key or key[0] < 0 or key[-1] >= self.world_size:
                raise ValueError(
                    f"group {list(key)} is empty or outside a world of {self.world_size}"
                )
            if seen.intersection(key) or len(set(key)) != len(key):
                raise ValueError(f"the groups {[list(k) for k in keys]} overlap")
            seen.update(key)
        return keys

    def groups_for(self, rank_lists: Sequence[Sequence[int]]) -> Any:
        """This rank's group among ``rank_lists`` (disjoint lists of global ranks, the same on
        every rank), making the groups not made yet in the order given. None: the world group
        (or this rank is in none of the lists)."""
        mine: Any = None
        for key in self._check_partition(rank_lists):
            if len(key) == self.world_size:
                group: Any = None
            elif key in self._groups:
                group = self._groups[key]
            else:
                made = _new_group(list(key))
                group = made if self.rank in key else _NOT_MEMBER
                self._groups[key] = group
            if self.rank in key:
                mine = group
        return mine

    def adopt(self, rank_lists: Sequence[Sequence[int]], mine: Any) -> None:
        """Record groups made elsewhere: ``rank_lists`` is every group of the partition (the
        same on every rank) and ``mine`` this rank's process group among them. They replace
        groups of the same ranks made before (whoever holds those keeps them)."""
        for key in self._check_partition(rank_lists):
            if len(key) < self.world_size:
                self._groups[key] = mine if self.rank in key else _NOT_MEMBER

    def __len__(self) -> int:
        return len(self._groups)


#: (id of the world group, the registry): a new process group makes the old registry stale
_REGISTRY: list[tuple[int, GroupRegistry]] = []
register_group_cache(_REGISTRY.clear)


def group_registry() -> GroupRegistry:
    """The registry of the live process group (made on first use)."""
    if not is_initialized():
        raise RuntimeError(
            "process groups need torch.distributed: call shardspeed.comm.init_distributed() "
            "(or shardspeed.initialize) first"
        )
    world = id(get_world_group())
    if not _REGISTRY or _REGISTRY[0][0] != world:
        _REGISTRY[:] = [(world, GroupRegistry(get_world_size(), get_rank()))]
    return _REGISTRY[0][1]


def groups_for(rank_lists: Sequence[Sequence[int]]) -> Any:
    """This rank's group among ``rank_lists`` (see :meth:`GroupRegistry.groups_for`)."""
    return group_registry().groups_for(rank_lists)


class Mesh:
    """Global ranks in a table with one named dimension per axis (outermost first).

    ``rank`` is the rank this mesh answers for (default: this process's; 0 with no process
    group). Groups are made only for a mesh of the live world describing this process.
    """

    def __init__(
        self, table: torch.Tensor, names: Sequence[str], *, rank: int | None = None
    ) -> None:
        names = tuple(names)
        if table.dim() != len(names):
            raise ValueError(f"a mesh of {table.dim()} dimensions needs as many names, got {names}")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"mesh axis names must be distinct non-empty strings, got {names}")
        flat = table.reshape(-1).tolist()
        if sorted(flat) != list(range(len(flat))):
            raise ValueError(f"a mesh must hold each rank 0..{len(flat) - 1} once, got {flat}")
        self.table = table.to(torch.int64)
        self.names = names
        self.world_size = len(flat)
        self._describes_self = rank is None
        if rank is None:
            rank = get_rank() if is_initialized() else 0
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        self.rank = int(rank)

    @classmethod
    def grid(cls, axes: Mapping[str, int], *, rank: int | None = None) -> Mesh:
        """Ranks laid out row-major over ``axes`` (outermost first; the last varies fastest)."""
        for name, size in axes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"axis {name!r} must have a positive integer size, got {size!r}")
        shape = tuple(axes.values())
        return cls(torch.arange(math.prod(shape)).reshape(shape), tuple(axes), rank=rank)

    # ------------------------------------------------------------------ shape
    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, outermost first."""
        return dict(zip(self.names, self.table.shape, strict=True))

    def _check(self, axes: Sequence[str]) -> None:
        for axis in axes:
            if axis not in self.names:
                close = difflib.get_close_matches(axis, list(self.names), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown mesh axis {axis!r}{hint} (axes: {list(self.names)})")

    def size(self, *axes: str) -> int:
        """Number of ranks in a group along ``axes`` (1 for no axes)."""
        self._check(axes)
        return math.prod(self.sizes[a] for a in axes)

    def coordinate(self, rank: int | None = None) -> dict[str, int]:
        """``rank``'s coordinate on every axis (default: this mesh's rank)."""
        rank = self.rank if rank is None else rank
        where = (self.table == rank).nonzero()
        if where.shape[0] != 1:
            raise ValueError(f"rank {rank} is not in this mesh of {self.world_size} ranks")
        return dict(zip(self.names, (int(i) for i in where[0]), strict=True))

    def reshape(self, names: Sequence[str], sizes: Sequence[int]) -> Mesh:
        """The same ranks with other axes: adjacent axes merged or one split, row-major (the
        product of sizes must not change)."""
        if math.prod(sizes) != self.world_size:
            raise ValueError(
                f"axes {dict(zip(names, sizes, strict=True))} do not hold {self.world_size} ranks"
            )
        view = Mesh(self.table.reshape(tuple(sizes)), names, rank=self.rank)
        view._describes_self = self._describes_self
        return view

    # ------------------------------------------------------------------ groups
    def rank_lists(self, *axes: str) -> list[list[int]]:
        """Every group along ``axes``: the ranks differing only there, each ascending (a
        process group's own rank order), ordered by their first rank."""
        self._check(axes)
        others = [i for i, n in enumerate(self.names) if n not in axes]
        along = [self.names.index(a) for a in axes]
        moved = self.table.permute(*others, *along).reshape(-1, self.size(*axes))
        return sorted(sorted(row.tolist()) for row in moved)

    def ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group along ``axes``, in group-rank order."""
        return next(r for r in self.rank_lists(*axes) if self.rank in r)

    def local_rank(self, *axes: str) -> int:
        """This rank's index inside its group along ``axes``."""
        return self.ranks(*axes).index(self.rank)

    def group(self, *axes: str) -> Any:
        """This rank's process group along ``axes`` (None: the world group), made with every
        other group along them on first use: every rank must ask in the same order."""
        if not self._describes_self or not is_initialized():
            raise RuntimeError(
                "this mesh has no process groups: it was built without a process group or "
                "for another rank (rank= given)"
            )
        if get_world_size() != self.world_size:
            raise RuntimeError(
                f"a mesh of {self.world_size} ranks cannot make groups in a world of "
                f"{get_world_size()}"
            )
        return groups_for(self.rank_lists(*axes))

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={s}" for a, s in self.sizes.items())
        return f"Mesh({axes}; rank {self.rank} of {self.world_size})"
