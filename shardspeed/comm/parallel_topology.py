"""The one topology of a training job: every parallelism's axis in one rank mesh.

Axes, outermost first (the last varies fastest, so its peers are consecutive ranks)::

    pp            pipeline stages
    dp_replicate  data-parallel replicas of the ZeRO shards (MiCS's / hpZ's replica groups)
    dp_shard      data-parallel ranks ZeRO splits state over (the whole data-parallel axis
                  unless MiCS shards within smaller groups)
    sp            sequence parallelism (Ulysses)
    tp            tensor (model) parallelism

This is DeepSpeed's pipe-data-model order for pipeline grids and Megatron's (tensor fastest,
then data, pipeline outermost). ``dp`` names ``dp_replicate`` and ``dp_shard`` together: the
data-parallel group gradients are averaged over.

Expert parallelism re-views the data-parallel axis (:meth:`ParallelTopology.expert_mesh`):
``dp`` splits into ``edp`` x ``ep`` (expert-parallel peers consecutive, DeepSpeed's default) or
``ep`` x ``edp`` (``use_data_before_expert_parallel``). MiCS re-views it as
``dp_replicate`` x ``dp_shard`` (:meth:`ParallelTopology.with_dp_shard`).

A job's topology is built once, in :func:`shardspeed.initialize`, from the config and any
``mpu`` (whose own groups are adopted, :meth:`ParallelTopology.from_mpu`), and made current
(:func:`set_current_topology`): ``shardspeed.utils.groups`` answers DeepSpeed's group queries
from it. Every process group comes from :mod:`shardspeed.comm.mesh`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardspeed.comm.collectives import all_gather_object
from shardspeed.comm.group_caches import register_group_cache
from shardspeed.comm.mesh import Mesh, group_registry
from shardspeed.comm.state import (
    get_all_ranks_from_group,
    get_world_group,
    get_world_size,
    is_initialized,
)

__all__ = [
    "AXES",
    "ParallelTopology",
    "current_topology",
    "set_current_topology",
]

AXES = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
#: what ``"dp"`` stands for
DP = ("dp_replicate", "dp_shard")


def _expand(axes: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for axis in axes:
        out.extend(DP if axis == "dp" else (axis,))
    return tuple(out)


class ParallelTopology:
    """The job's rank mesh over :data:`AXES`, with the expert-parallel views made from it."""

    def __init__(self, mesh: Mesh) -> None:
        if mesh.names != AXES:
            raise ValueError(f"a ParallelTopology's mesh has the axes {AXES}, got {mesh.names}")
        self.mesh = mesh
        self._experts: dict[tuple[int, bool], Mesh] = {}
        #: the model-parallel unit this grid came from (``utils.groups.get_mpu``), if any
        self.mpu: Any = None
        #: the axes whose groups that unit lends (they exist even with one rank on them)
        self.lent_axes: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        *,
        pp: int = 1,
        tp: int = 1,
        sp: int = 1,
        dp_shard: int | None = None,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> ParallelTopology:
        """Row-major grid of ``world_size`` ranks (default: the live world); data parallelism
        takes what the other axes leave, sharded over groups of ``dp_shard`` (default: all)."""
        if world_size is None:
            world_size = get_world_size() if is_initialized() else 1
        for name, size in (("pp", pp), ("tp", tp), ("sp", sp)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"the {name} size must be a positive integer, got {size!r}")
        if world_size % (pp * tp * sp):
            raise ValueError(
                f"pipeline ({pp}) x sequence ({sp}) x tensor ({tp}) parallel sizes multiply to "
                f"{pp * tp * sp}, which does not divide the world size {world_size}; launch a "
                "multiple of that many ranks or choose sizes that divide it"
            )
        dp = world_size // (pp * tp * sp)
        shard = dp if dp_shard is None else dp_shard
        _check_shard(shard, dp, "data-parallel size")
        sizes = {"pp": pp, "dp_replicate": dp // shard, "dp_shard": shard, "sp": sp, "tp": tp}
        return cls(Mesh.grid(sizes, rank=rank))

    @classmethod
    def from_table(cls, table: torch.Tensor) -> ParallelTopology:
        """From a rank table of shape (pp, dp, sp, tp): where a pipeline module or an ``mpu``
        put each rank."""
        pp, dp, sp, tp = table.shape
        return cls(Mesh(table.reshape(pp, 1, dp, sp, tp), AXES))

    @classmethod
    def from_mpu(cls, mpu: Any) -> ParallelTopology:
        """The grid of a Megatron-style model-parallel unit (every rank calls it): where each
        rank sits is gathered from the ``mpu``'s ranks, and its groups are adopted, not
        remade. Reads ``get_{tensor_model,slice,model}_parallel_*`` (tensor),
        ``get_{pipe,pipeline_model}_parallel_*`` (pipeline), ``get_sequence_parallel_*`` and
        ``get_data_parallel_*``."""
        axes = {
            "pp": _mpu_axis(mpu, ("pipe_parallel", "pipeline_model_parallel")),
            "dp": _mpu_axis(mpu, ("data_parallel",)),
            "sp": _mpu_axis(mpu, ("sequence_parallel",)),
            "tp": _mpu_axis(mpu, ("tensor_model_parallel", "slice_parallel", "model_parallel")),
        }
        if axes["pp"] is not None and axes["tp"] is not None and axes["tp"][0] == "model_parallel":
            # DeepSpeed's pipeline grid: its "model parallel" group holds the stages too
            axes["tp"] = _mpu_axis(mpu, ("slice_parallel",))
        sizes = {name: 1 if q is None else q[1]() for name, q in axes.items()}
        mine = tuple(0 if q is None else int(q[2]()) for q in axes.values())
        world = get_world_size()
        if sizes["pp"] * sizes["dp"] * sizes["sp"] * sizes["tp"] != world:
            raise ValueError(
                f"the mpu's sizes {sizes} do not multiply to the world size {world}; its "
                "get_*_parallel_world_size() answers disagree with the launched ranks"
            )
        places: list[Any] = [None] * world
        all_gather_object(places, mine)
        table = torch.full(tuple(sizes.values()), -1, dtype=torch.int64)
        for rank, place in enumerate(places):
            if table[place] != -1:
                raise ValueError(
                    f"the mpu puts ranks {int(table[place])} and {rank} at the same place "
                    f"{dict(zip(sizes, place, strict=True))}; its get_*_parallel_rank() "
                    "answers must differ between ranks"
                )
            table[place] = rank
        topology = cls.from_table(table)
        topology.lent_axes = frozenset(name for name, query in axes.items() if query is not None)
        registry = group_registry()
        for name, query in axes.items():
            if query is None or sizes[name] == 1:
                continue
            along = DP if name == "dp" else (name,)
            lists = topology.mesh.rank_lists(*along)
            group = query[3]()
            if sorted(get_all_ranks_from_group(group)) != topology.mesh.ranks(*along):
                raise ValueError(
                    f"the mpu's {name} group holds ranks {get_all_ranks_from_group(group)} but "
                    f"its ranks place this rank's {name} peers at {topology.mesh.ranks(*along)}"
                )
            registry.adopt(lists, group)
        return topology

    # ------------------------------------------------------------------ queries
    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size."""
        return self.mesh.sizes

    def size(self, *axes: str) -> int:
        """Ranks in a group along ``axes`` (``"dp"``: both data-parallel axes)."""
        return self.mesh.size(*_expand(axes))

    def local_rank(self, *axes: str) -> int:
        """This rank's index in its group along ``axes``."""
        return self.mesh.local_rank(*_expand(axes))

    def ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group along ``axes``."""
        return self.mesh.ranks(*_expand(axes))

    def group(self, *axes: str) -> Any:
        """This rank's process group along ``axes`` (None: the world group)."""
        return self.mesh.group(*_expand(axes))

    def tensor_replica_group(self, size: int) -> Any:
        """This rank's group of ``size`` consecutive tensor-parallel ranks (those holding the
        same copy of a key/value head when there are fewer heads than ranks)."""
        s = self.sizes
        if size < 1 or s["tp"] % size:
            raise ValueError(f"{size} does not divide the tensor-parallel size {s['tp']}")
        names = ("pp", "dp_replicate", "dp_shard", "sp", "tp_outer", "tp_inner")
        view = self.mesh.reshape(
            names, (s["pp"], s["dp_replicate"], s["dp_shard"], s["sp"], s["tp"] // size, size)
        )
        return view.group("tp_inner")

    def sequence_subgroups(self, ulysses_size: int) -> tuple[Any, Any]:
        """The sequence-parallel axis split as ``ring x ulysses`` (Ulysses peers consecutive):
        this rank's (Ulysses group, ring group), the ring joining the ranks at the same place
        of consecutive Ulysses groups. Every rank must ask, in the same order."""
        s = self.sizes
        if ulysses_size < 1 or s["sp"] % ulysses_size:
            raise ValueError(
                f"a Ulysses group of {ulysses_size} ranks must divide the sequence-parallel "
                f"size {s['sp']}"
            )
        names = ("pp", "dp_replicate", "dp_shard", "sp_ring", "sp_ulysses", "tp")
        view = self.mesh.reshape(
            names,
            (
                s["pp"],
                s["dp_replicate"],
                s["dp_shard"],
                s["sp"] // ulysses_size,
                ulysses_size,
                s["tp"],
            ),
        )
        return view.group("sp_ulysses"), view.group("sp_ring")

    # ------------------------------------------------------------------ views
    def with_dp_shard(self, shard: int) -> ParallelTopology:
        """The same ranks with ZeRO state sharded within groups of ``shard`` consecutive
        data-parallel ranks and replicated across the groups (MiCS)."""
        dp = self.size("dp")
        _check_shard(shard, dp, "data-parallel size")
        s = self.sizes
        view = ParallelTopology(
            self.mesh.reshape(AXES, (s["pp"], dp // shard, shard, s["sp"], s["tp"]))
        )
        view.mpu, view.lent_axes = self.mpu, self.lent_axes
        return view

    def expert_mesh(self, ep_size: int, data_before_expert: bool = False) -> Mesh:
        """The data-parallel axis split for expert parallelism of ``ep_size``: axes
        ``(pp, edp, ep, sp, tp)``, or ``(pp, ep, edp, sp, tp)`` with ``data_before_expert``
        (expert-data-parallel peers consecutive). Made once per size and order."""
        key = (int(ep_size), bool(data_before_expert))
        if key not in self._experts:
            dp = self.size("dp")
            if ep_size < 1 or dp % ep_size:
                raise ValueError(
                    f"ep_size={ep_size} must divide the data-parallel size ({dp}); choose an "
                    f"ep_size among {[d for d in range(1, dp + 1) if dp % d == 0]}"
                )
            s = self.sizes
            inner = (("ep", "edp"), (ep_size, dp // ep_size))
            if not data_before_expert:
                inner = (("edp", "ep"), (dp // ep_size, ep_size))
            names = ("pp", *inner[0], "sp", "tp")
            self._experts[key] = self.mesh.reshape(names, (s["pp"], *inner[1], s["sp"], s["tp"]))
        return self._experts[key]

    def expert_meshes(self) -> dict[tuple[int, bool], Mesh]:
        """The expert views made so far, by (ep size, data before expert)."""
        return dict(self._experts)

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={n}" for a, n in self.sizes.items())
        return f"ParallelTopology({axes}; rank {self.mesh.rank} of {self.mesh.world_size})"


def _check_shard(shard: int, dp: int, what: str) -> None:
    if not isinstance(shard, int) or shard < 1 or dp % shard:
        raise ValueError(
            f"a shard group of {shard!r} ranks must divide the {what} ({dp}); choose one of "
            f"{[d for d in range(1, dp + 1) if dp % d == 0]}"
        )


def _mpu_axis(
    mpu: Any, names: Sequence[str]
) -> tuple[str, Callable[[], int], Callable[[], int], Callable[[], Any]] | None:
    """(name, world size, rank, group) getters of the first of ``names`` the mpu answers."""
    for name in names:
        getters = [getattr(mpu, f"get_{name}_{what}", None) for what in ("world_size", "rank")]
        group = getattr(mpu, f"get_{name}_group", None)
        if getters[0] is not None and getters[1] is not None and group is not None:
            return name, getters[0], getters[1], group
    return None


#: (id of the world group, the current topology)
_CURRENT: list[tuple[int, ParallelTopology]] = []
register_group_cache(_CURRENT.clear)


def set_current_topology(topology: ParallelTopology | None) -> None:
    """Make ``topology`` the one ``shardspeed.utils.groups`` answers from (None: forget it)."""
    _CURRENT.clear()
    if topology is not None:
        _CURRENT.append((id(get_world_group()) if is_initialized() else 0, topology))


def current_topology() -> ParallelTopology:
    """The job's topology: the last one :func:`shardspeed.initialize` (or
    ``groups.initialize``) set, else every rank on the data-parallel axis."""
    world = id(get_world_group()) if is_initialized() else 0
    if not _CURRENT or _CURRENT[0][0] != world:
        set_current_topology(ParallelTopology.build())
    return _CURRENT[0][1]
