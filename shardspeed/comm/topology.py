"""The rank grid with named axes, and one process group per axis for this rank.

Layout: axes are listed outermost-first and ranks are laid out row-major, so the LAST axis
varies fastest. ``Topology(axes={"pipe": 2, "data": 2, "tensor": 2})`` puts tensor-parallel
peers on consecutive ranks (rank 0 and 1), data-parallel peers two apart, pipeline stages four
apart, as DeepSpeed's ``ProcessTopology(["pipe", "data", "model"])`` does. Put the axis with
the most traffic last (it then stays inside a node); data is usually next-to-last.

Groups: torch requires every rank to call ``new_group`` for every group, in the same order,
even for groups it is not in. A Topology therefore asks :func:`shardspeed.comm.mesh.groups_for`
for all groups eagerly in its constructor, in a fixed order (axes in the order given; within an
axis, groups in ascending order of their first rank), and every rank must construct the same
Topologies in the same order; groups of the same ranks made before are reused.
An axis that spans the whole world needs no new group: its group is None, which every
collective reads as the world group.
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Mapping
from typing import Any

from shardspeed.comm.mesh import groups_for
from shardspeed.comm.state import get_rank, get_world_size, is_initialized


class Topology:
    """A grid of ``world_size`` ranks with named axes (see the module docstring for layout).

    ``axes`` maps axis name to size, outermost first; the default is ``{"data": world_size}``.
    ``rank`` / ``world_size`` default to this process's (or 0 / the grid size when no process
    group exists, which allows pure grid arithmetic). Groups are made only when a process group
    exists and this Topology describes this process (``rank`` and ``world_size`` not given).
    """

    def __init__(
        self,
        axes: Mapping[str, int] | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        live = is_initialized()
        describes_self = rank is None and world_size is None
        if world_size is None:
            world_size = get_world_size() if live else math.prod((axes or {"data": 1}).values())
        if rank is None:
            rank = get_rank() if live else 0
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.axes: dict[str, int] = dict(axes) if axes else {"data": self.world_size}
        self._validate()
        self._groups: dict[str, Any] = {}
        if live and describes_self:
            self._create_groups()

    def _validate(self) -> None:
        for name, size in self.axes.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"axis names must be non-empty strings, got {name!r}")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"axis {name!r} must have a positive integer size, got {size!r}")
        product = math.prod(self.axes.values())
        if product != self.world_size:
            raise ValueError(
                f"axes {self.axes} multiply to {product} ranks but the world has "
                f"{self.world_size}; make the sizes' product equal the world size"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

    def _create_groups(self) -> None:
        for axis in self.axes:
            if self.axes[axis] == self.world_size:
                self._groups[axis] = None
                continue
            self._groups[axis] = groups_for(self.get_axis_groups(axis))

    # ------------------------------------------------------------------ grid arithmetic
    def _check_axis(self, axis: str) -> None:
        if axis not in self.axes:
            close = difflib.get_close_matches(axis, list(self.axes), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown axis {axis!r}{hint} (this topology has {list(self.axes)})")

    @property
    def axis_names(self) -> list[str]:
        """Axis names, outermost first."""
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis`` (DeepSpeed's name for :meth:`get_world_size`)."""
        self._check_axis(axis)
        return self.axes[axis]

    def get_coord(self, rank: int) -> dict[str, int]:
        """Coordinates of global ``rank`` on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        coord: dict[str, int] = {}
        for axis in reversed(self.axes):
            rank, coord[axis] = divmod(rank, self.axes[axis])
        return {axis: coord[axis] for axis in self.axes}

    def rank_of(self, **coords: int) -> int:
        """Global rank at ``coords`` (every axis must be given)."""
        missing = [a for a in self.axes if a not in coords]
        for axis in coords:
            self._check_axis(axis)
        if missing:
            raise ValueError(f"rank_of needs every axis; missing {missing}")
        rank = 0
        for axis, size in self.axes.items():
            if not 0 <= coords[axis] < size:
                raise ValueError(f"coordinate {axis}={coords[axis]} is outside [0, {size})")
            rank = rank * size + coords[axis]
        return rank

    def get_axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: ranks that differ only in their ``axis`` coordinate.

        Ordered by first rank, which is the order groups are created in.
        """
        self._check_axis(axis)
        others = [a for a in self.axes if a != axis]
        groups = []
        for fixed in itertools.product(*(range(self.axes[a]) for a in others)):
            base = dict(zip(others, fixed, strict=True))
            groups.append([self.rank_of(**base, **{axis: i}) for i in range(self.axes[axis])])
        return sorted(groups)

    # ------------------------------------------------------------------ this rank's view
    def get_world_size(self, axis: str) -> int:
        """Number of ranks in this rank's ``axis`` group."""
        return self.get_dim(axis)

    def get_rank(self, axis: str) -> int:
        """This rank's index inside its ``axis`` group (its coordinate on that axis)."""
        self._check_axis(axis)
        return self.get_coord(self.rank)[axis]

    def get_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in group-rank order."""
        coord = self.get_coord(self.rank)
        return [self.rank_of(**{**coord, axis: i}) for i in range(self.get_dim(axis))]

    def get_group(self, axis: str) -> Any:
        """This rank's process group along ``axis``; None means the world group."""
        self._check_axis(axis)
        if axis not in self._groups:
            if self.axes[axis] == self.world_size:
                return None
            raise RuntimeError(
                "this Topology has no process groups: it was built without a process group, "
                "or for another rank/world (rank= / world_size= given)"
            )
        return self._groups[axis]

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={s}" for a, s in self.axes.items())
        return f"Topology({axes}; rank {self.rank} of {self.world_size})"
