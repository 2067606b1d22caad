"""Always-on byte counts per collective, and the nccl-tests bus-bandwidth factors.

Every collective in :mod:`shardspeed.comm` adds its message size here, with no device sync and
no timing, so tests and benchmarks can assert how much a strategy communicates. Message size
follows nccl-tests: all_reduce counts the tensor; all_gather counts the gathered OUTPUT;
reduce_scatter counts the full INPUT; all_to_all counts the input; broadcast, reduce, gather,
scatter and point-to-point count the tensor that moves. ``bus_bytes`` is ``bytes`` times the
op's bus factor for the group size ``n`` (all_reduce ``2(n-1)/n``; all_gather, reduce_scatter
and all_to_all ``(n-1)/n``; everything else 1), i.e. the bytes each rank's link carries.

Counts are per process; a rank counts the collectives it took part in. The same totals are also
kept per group size (``get_comm_volume(by_group_size=True)``: keys ``"op/n"``), so a test can tell
a collective inside a node-sized group from one over the world (ZeRO++'s hierarchical modes), and
for the calls over groups whose ranks sit on more than one node
(``get_comm_volume(crossing_nodes=True)``; a node is ``LOCAL_WORLD_SIZE`` consecutive global
ranks): the traffic a slow inter-node link carries.
"""

from __future__ import annotations

import copy
from typing import TypedDict

_ALL_REDUCE_LIKE = frozenset({"all_reduce", "inference_all_reduce", "all_reduce_coalesced"})
_RING_LIKE = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
    }
)


def bus_factor(op: str, group_size: int) -> float:
    """The nccl-tests factor turning algorithm bandwidth into bus bandwidth for ``op``."""
    n = max(group_size, 1)
    if op in _ALL_REDUCE_LIKE:
        return 2.0 * (n - 1) / n
    if op in _RING_LIKE:
        return (n - 1) / n
    return 1.0


class OpVolume(TypedDict):
    """Totals for one op name."""

    count: int
    bytes: int
    bus_bytes: float


class CommVolume:
    """Per-op call count, message bytes and bus bytes since the last reset."""

    def __init__(self) -> None:
        self._ops: dict[str, OpVolume] = {}
        self._by_size: dict[str, OpVolume] = {}
        self._crossing: dict[str, OpVolume] = {}

    def record(self, op: str, nbytes: int, group_size: int, crosses_nodes: bool = False) -> None:
        """Add one call of ``op`` moving ``nbytes`` over a group of ``group_size`` ranks
        (spanning more than one node if ``crosses_nodes``)."""
        bus = nbytes * bus_factor(op, group_size)
        tables = [(self._ops, op), (self._by_size, f"{op}/{group_size}")]
        if crosses_nodes:
            tables.append((self._crossing, op))
        for table, key in tables:
            entry = table.get(key)
            if entry is None:
                entry = table[key] = OpVolume(count=0, bytes=0, bus_bytes=0.0)
            entry["count"] += 1
            entry["bytes"] += nbytes
            entry["bus_bytes"] += bus

    def snapshot(
        self, by_group_size: bool = False, crossing_nodes: bool = False
    ) -> dict[str, OpVolume]:
        """A copy of the totals: op name -> {"count", "bytes", "bus_bytes"}; with
        ``by_group_size``, keyed ``"op/n"`` for the calls over groups of ``n`` ranks; with
        ``crossing_nodes``, only the calls over groups spanning more than one node."""
        if crossing_nodes:
            return copy.deepcopy(self._crossing)
        return copy.deepcopy(self._by_size if by_group_size else self._ops)

    def reset(self) -> None:
        """Forget every total."""
        self._ops.clear()
        self._by_size.clear()
        self._crossing.clear()


# One counter per process, like the process's default group: collectives have no other object
# to hang it on, and a benchmark wants the total whatever module issued the call.
_VOLUME = CommVolume()


def record_volume(op: str, nbytes: int, group_size: int, crosses_nodes: bool = False) -> None:
    """Add one call to the process's counter."""
    _VOLUME.record(op, nbytes, group_size, crosses_nodes)


def get_comm_volume(
    by_group_size: bool = False, crossing_nodes: bool = False
) -> dict[str, OpVolume]:
    """Totals since the last :func:`reset_comm_volume`: op -> {"count", "bytes", "bus_bytes"}
    (``by_group_size``: ``"op/n"`` -> the same, for groups of ``n`` ranks; ``crossing_nodes``:
    only the calls over groups spanning more than one node)."""
    return _VOLUME.snapshot(by_group_size, crossing_nodes)


def reset_comm_volume() -> None:
    """Zero the process's counter."""
    _VOLUME.reset()
