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

import torch

from shardspeed import comm
from shardspeed.comm.mesh import groups_for
from shardspeed.comm.parallel_topology import ParallelTopology
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


def _prime_factors(N: int) -> list[int]:
    """The prime factors of ``N`` in ascending order, repeated by multiplicity (``[]`` for 1)."""
    if N <= 0:
        raise ValueError(f"_prime_factors({N}): values must be strictly positive")
    primes: list[int] = []
    candidate = 2
    while N > 1:
        while N % candidate == 0:
            primes.append(candidate)
            N //= candidate
        candidate += 1
    return primes


class InvalidGridError(ValueError, AssertionError):
    """The topology's rank count is not the world size (DeepSpeed asserts "Invalid Grid")."""


class PipelineParallelGrid:
    """This rank's place in a pipeline grid and its process groups: the ``mpu`` object
    DeepSpeed hands to Megatron-style code (data-, pipe-, model- and slice-parallel queries).

    As in DeepSpeed, ``dp_group`` / ``pp_group`` / ``slice_group`` are this rank's rank lists
    and ``dp_proc_group`` / ``pp_proc_group`` / ``slice_proc_group`` the process groups;
    ``model_parallel_size`` is the ``model`` (tensor-slice) axis, while the model-parallel
    *group* of :meth:`get_model_parallel_group` is every rank with this rank's data coordinate
    (pipeline stages times tensor slices: the ranks that together hold one copy of the model).
    Without a topology the world's prime factors are dealt alternately to pipe and data.
    Every rank must build the same grids in the same order (they create process groups).
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        del process_group  # DeepSpeed's argument; the world is always the grid here
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        if topology is None:
            pp, dp = 1, 1
            for index, prime in enumerate(_prime_factors(self.world_size)):
                if index % 2 == 0:
                    pp *= prime
                else:
                    dp *= prime
            topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        self._topo = topology
        if not self._is_grid_valid():
            raise InvalidGridError(
                f"the pipeline topology {dict(zip(topology.axes, topology.dims, strict=True))} "
                f"has {topology.world_size()} ranks but the world has {self.world_size}; make "
                "the product of its dims equal the number of processes"
            )
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = topology.get_coord(self.global_rank)
        self.stage_id = int(getattr(coord, "pipe", 0))
        self.data_parallel_id = int(getattr(coord, "data", 0))
        self.slice_parallel_id = int(getattr(coord, "model", 0))
        # model parallel (DeepSpeed's "ds_model" groups): the ranks of one data coordinate
        self.ds_model_proc_group, ranks = self._groups_over(
            [topology.filter_match(data=d) for d in range(self.data_parallel_size)]
            if "data" in topology.axes
            else [list(range(self.world_size))]
        )
        self.ds_model_rank = ranks.index(self.global_rank)
        self.ds_model_world_size = len(ranks)
        self.dp_groups = self._comm_lists("data")
        self.dp_proc_group, self.dp_group = self._groups_over(self.dp_groups)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.p2p_groups = self._build_p2p_groups()
        self.pipe_groups = self._comm_lists("pipe")
        self.pp_proc_group, self.pp_group = self._groups_over(self.pipe_groups)
        self.model_groups = self._comm_lists("model")
        self.slice_proc_group, self.slice_group = self._groups_over(self.model_groups)
        #: the job's topology this grid describes
        self.parallel_topology = self._parallel_topology()

    def _parallel_topology(self) -> ParallelTopology:
        """The grid as the job's :class:`ParallelTopology`: pipe -> ``pp``, data -> ``dp``,
        every other axis (``model``) -> ``tp``; its groups are the ones made above."""
        topo = self._topo
        order = [topo.axes.index(a) for a in ("pipe", "data") if a in topo.axes]
        order += [i for i, a in enumerate(topo.axes) if a not in ("pipe", "data")]
        table = torch.arange(self.world_size).reshape(topo.dims).permute(order)
        pp = topo.get_dim("pipe") if "pipe" in topo.axes else 1
        dp = topo.get_dim("data") if "data" in topo.axes else 1
        return ParallelTopology.from_table(table.reshape(pp, dp, 1, self.world_size // (pp * dp)))

    def _comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists along ``axis``; one list per rank when the grid lacks the axis."""
        lists = self._topo.get_axis_comm_lists(axis)
        return lists or [[rank] for rank in range(self.world_size)]

    def _groups_over(self, rank_lists: list[list[int]]) -> tuple[Any, list[int]]:
        """One process group per list (every rank asks for every group, in order; groups of the
        same ranks made before are reused); returns this rank's group and list. A list
        spanning the world uses the world group (None)."""
        mine = next(list(ranks) for ranks in rank_lists if self.global_rank in ranks)
        return groups_for(rank_lists), mine

    def _build_p2p_groups(self) -> list[list[int]]:
        """``[rank, next stage's rank]`` for every rank (the last stage wraps to the first)."""
        pairs: list[list[int]] = []
        for rank in range(self.world_size):
            line = next(ranks for ranks in self._comm_lists("pipe") if rank in ranks)
            pairs.append([rank, line[(line.index(rank) + 1) % len(line)]])
        return pairs

    def _is_grid_valid(self) -> bool:
        """Whether the topology has exactly as many ranks as the world."""
        return math.prod(self._topo.get_dim(a) for a in self._topo.get_axis_names()) == (
            comm.get_world_size()
        )

    # -- stages --------------------------------------------------------------------------
    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or ``kwargs``)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(kwargs)
        coord["pipe"] = stage_id
        return self._topo.get_rank(**coord)

    def topology(self) -> ProcessTopology:
        return self._topo

    # -- the mpu interface -----------------------------------------------------------------
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return self.slice_parallel_id

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    # Megatron's names for the slice (tensor) axis
    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group
