"""DeepSpeed's ``ProcessTopology``: the n-D rank grid of pipeline/data/model parallelism.

Pure rank arithmetic on top of :class:`shardspeed.comm.Topology` (which also builds process
groups): coordinates map to ranks row-major, the last axis varying fastest, so
``ProcessTopology(["x", "y"], [2, 3]).get_rank(x=0, y=1) == 1``.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Iterable, Sequence
from typing import Any

from shardspeed.comm.topology import Topology


class ProcessTopology:
    """Ranks laid out on named axes ``axes`` of sizes ``dims`` (outermost first)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(
                f"ProcessTopology: {len(axes)} axes {list(axes)} but dims {list(dims)}"
            )
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        size = math.prod(self.dims)
        self._grid = Topology(dict(zip(self.axes, self.dims, strict=True)), rank=0, world_size=size)
        #: coordinate -> rank, as DeepSpeed exposes it
        self.mapping = {self.get_coord(rank): rank for rank in range(size)}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the given coordinates (every axis)."""
        return self._grid.rank_of(**coord_kwargs)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Iterable[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """A name for ``rank`` from its coordinates on the axes not omitted, e.g. ``a_01-b_01``
        (used in checkpoint file names)."""
        omit = set(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit
        )

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 for an axis this grid does not have, as DeepSpeed returns)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """``rank``'s coordinates, a ``ProcessCoord`` namedtuple."""
        return self.ProcessCoord(**self._grid.get_coord(rank))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists of every communicator along ``axis`` (ranks differing only there);
        empty for an axis this grid does not have."""
        return self._grid.get_axis_groups(axis) if axis in self.axes else []

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every ``axis=value`` given, ascending."""
        for axis in filter_kwargs:
            self._grid.get_dim(axis)  # unknown axes raise, naming the axes there are
        return [
            rank
            for coord, rank in sorted(self.mapping.items(), key=lambda item: item[1])
            if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``, ascending."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return math.prod(self.dims)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages outermost, data-parallel replicas innermost (adjacent ranks)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model (tensor) parallelism; model-parallel peers are adjacent."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
