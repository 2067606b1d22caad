"""ZeRO++ (arXiv 2306.10209) settings of a stage-3 shard group: which of its collectives are
quantized or hierarchical, and over which groups.

* **hpZ** (``zero_hpz_partition_size`` = k > 1): besides this rank's primary shard (over all N
  data-parallel ranks), a unit gathered for a forward keeps a *secondary* shard, its 1/k part
  within a group of k consecutive ranks (a node), so the backward's re-gather stays inside the
  group (:attr:`ZeroPP.secondary`).
* **qwZ** (``zero_quantized_weights``): the hooks' parameter all-gathers carry blockwise int8
  codes and scales (:mod:`~shardspeed.runtime.comm.quantize`); gathers whose values are kept
  (``GatheredParameters``, state dicts, checkpoints) stay exact.
  ``zero_quantized_nontrainable_weights`` also stores frozen parameters' shards quantized.
* **qgZ** (``zero_quantized_gradients``): the gradient reduce-scatter is an all-to-all of int4
  codes inside the node group, a local fp32 sum, then an all-to-all across the node groups
  (:attr:`ZeroPP.local`, :attr:`ZeroPP.cross`), with LoCo's error feedback when
  ``zeropp_loco_param`` is set.

The node size is ``zero_hpz_partition_size`` when it is above 1, else the launcher's
``LOCAL_WORLD_SIZE`` when it divides the data-parallel size, else the whole group (one level).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from shardspeed.comm.parallel_topology import ParallelTopology
from shardspeed.runtime.zero.comm_group import CommGroup


@dataclass(frozen=True)
class LocoSettings:
    """``zeropp_loco_param``: the error buffers' moving-average coefficient and how many
    reductions pass between their clears."""

    err_beta: float = 0.8
    reset_t: int = 1024

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> LocoSettings:
        """``{"err_beta": ..., "reset_T": ...}``, checked."""
        unknown = set(raw) - {"err_beta", "reset_T"}
        if unknown:
            raise ValueError(
                f"zero_optimization.zeropp_loco_param has unknown keys {sorted(unknown)}; it "
                'takes "err_beta" (0..1) and "reset_T" (steps)'
            )
        beta = float(raw.get("err_beta", 0.8))
        reset = raw.get("reset_T", 1024)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"zeropp_loco_param.err_beta={beta} must be in [0, 1]")
        if not isinstance(reset, int) or isinstance(reset, bool) or reset < 1:
            raise ValueError(f"zeropp_loco_param.reset_T={reset!r} must be a positive integer")
        return cls(beta, reset)


@dataclass(frozen=True, eq=False)
class ZeroPP:
    """The ZeRO++ modes of one shard group (compared and hashed by identity: it holds the
    mutable LoCo error state)."""

    #: qwZ: the hooks' all-gathers carry int8 codes
    quantized_weights: bool = False
    #: store frozen parameters' shards as int8 codes
    quantized_nontrainable_weights: bool = False
    #: hpZ: the group of consecutive ranks a secondary shard is split over (None: off)
    secondary: CommGroup | None = None
    #: qgZ: the gradient reduce-scatter is a quantized two-level all-to-all
    quantized_gradients: bool = False
    #: qgZ's first level: this rank's node group (None: one level, over the whole group)
    local: CommGroup | None = None
    #: qgZ's second level: the ranks at this rank's place in the other node groups
    cross: CommGroup | None = None
    #: LoCo error feedback on the quantized gradients (None: off)
    loco: LocoSettings | None = None
    #: LoCo's error buffers, by the reduction's key (filled by the reduce-scatter)
    errors: dict[Any, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether any mode is on."""
        return (
            self.quantized_weights
            or self.quantized_nontrainable_weights
            or self.secondary is not None
            or self.quantized_gradients
        )


def node_size(hpz: int, dp: int) -> int:
    """The ranks of one node group (see the module docstring)."""
    if hpz > 1:
        return hpz
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if local.isdigit() and 1 < int(local) < dp and dp % int(local) == 0:
        return int(local)
    return dp


def zeropp_comm(topology: ParallelTopology, zero: Any, data_parallel: CommGroup) -> CommGroup:
    """``data_parallel`` with the ZeRO++ modes ``zero`` (the ``zero_optimization`` section)
    asks for (every rank calls it, in the same order: it may create groups)."""
    dp = topology.size("dp")
    hpz = int(zero.zero_hpz_partition_size)
    if hpz > 1 and dp % hpz:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={hpz} must divide the data-parallel "
            f"size ({dp}); "
            + (
                f"choose one of {[d for d in range(2, dp + 1) if dp % d == 0]} (the ranks of one "
                "node), or 1 to turn hpZ off"
                if dp > 1
                else "with one data-parallel rank there is nothing to partition: set it to 1"
            )
        )
    if data_parallel.world_size != dp:
        raise NotImplementedError(
            "ZeRO++ (zero_hpz_partition_size / zero_quantized_*) with sequence parallelism is "
            "not supported in shardspeed; remove the ZeRO++ keys or set "
            "sequence_parallel_size to 1"
        )
    node = node_size(hpz, dp)
    local = cross = secondary = None
    if node < dp:
        grid = topology.with_dp_shard(node)
        local = CommGroup.of(grid.group("dp_shard"))
        cross = CommGroup.of(grid.group("dp_replicate"))
        # (on one node hpZ has nothing to do: the secondary shard would be the primary one)
        secondary = local if hpz > 1 else None
    raw_loco = zero.zeropp_loco_param
    loco = LocoSettings.parse(raw_loco) if raw_loco is not None else None
    settings = ZeroPP(
        quantized_weights=bool(zero.zero_quantized_weights),
        quantized_nontrainable_weights=bool(zero.zero_quantized_nontrainable_weights),
        secondary=secondary,
        quantized_gradients=bool(zero.zero_quantized_gradients),
        local=local,
        cross=cross,
        loco=loco if zero.zero_quantized_gradients else None,
    )
    return dataclasses.replace(data_parallel, zeropp=settings)


def asks_zeropp(zero: Any) -> bool:
    """Whether the ``zero_optimization`` section turns any ZeRO++ mode on."""
    return bool(
        int(zero.zero_hpz_partition_size) > 1
        or zero.zero_quantized_weights
        or zero.zero_quantized_nontrainable_weights
        or zero.zero_quantized_gradients
    )


def step_traffic(
    settings: ZeroPP, world: int, gathers: list[tuple[int, int]], reductions: list[tuple[int, int]]
) -> dict[str, float]:
    """Bus bytes per rank of one training step (a forward, its backward, one reduction) over
    groups that span nodes (``cross_*``) and in all (``total_*``), for plain ZeRO-3
    (``*_plain``) and with ``settings``; ``gathers`` are the released buffers' (elements, bytes
    per element), ``reductions`` the gradient buckets' (the byte counter's accounting, as
    :mod:`shardspeed.comm.volume` states it)."""
    from shardspeed.runtime.comm.quantize import INT4, INT8

    node = settings.local.world_size if settings.local is not None else world
    crosses = node < world
    ring = (world - 1) / world
    totals = dict.fromkeys(("cross_plain", "total_plain", "cross", "total"), 0.0)

    def add(kind: str, nbytes: float, factor: float, crossing: bool) -> None:
        suffix = "_plain" if kind == "plain" else ""
        totals["total" + suffix] += nbytes * factor
        if crossing:
            totals["cross" + suffix] += nbytes * factor

    for numel, size in gathers:
        add("plain", 2 * numel * size, ring, crosses)
        sent = (
            world * INT8.payload_nbytes(numel // world)
            if settings.quantized_weights
            else numel * size
        )
        add("zeropp", sent, ring, crosses)  # the forward's
        if settings.secondary is not None:
            k = settings.secondary.world_size
            add("zeropp", numel * size, (k - 1) / k, False)
        else:
            add("zeropp", sent, ring, crosses)
    for numel, size in reductions:
        add("plain", numel * size, ring, crosses)
        if not settings.quantized_gradients:
            add("zeropp", numel * size, ring, crosses)
        elif settings.local is None or settings.cross is None:
            add("zeropp", world * INT4.payload_nbytes(numel // world), ring, crosses)
        else:
            nodes = settings.cross.world_size
            add("zeropp", node * INT4.payload_nbytes(numel // node), (node - 1) / node, False)
            add("zeropp", nodes * INT4.payload_nbytes(numel // world), (nodes - 1) / nodes, True)
    return totals


def traffic_line(settings: ZeroPP, traffic: dict[str, float]) -> str:
    """The log line stating what ``settings`` saves per step (from :func:`step_traffic`)."""
    modes = []
    if settings.secondary is not None:
        modes.append(f"hpZ over {settings.secondary.world_size} ranks")
    if settings.quantized_weights:
        modes.append("qwZ int8")
    if settings.quantized_nontrainable_weights:
        modes.append("frozen weights int8")
    if settings.quantized_gradients:
        modes.append("qgZ int4" + (" + LoCo" if settings.loco is not None else ""))
    mb = 1 / 2**20
    line = (
        f"ZeRO++ ({', '.join(modes)}): about {traffic['total'] * mb:.2f} MB of bus traffic per "
        f"rank per step instead of plain ZeRO-3's {traffic['total_plain'] * mb:.2f} MB"
    )
    if traffic["cross_plain"] > 0:
        line += (
            f"; across nodes {traffic['cross'] * mb:.2f} MB instead of "
            f"{traffic['cross_plain'] * mb:.2f} MB "
            f"({traffic['cross_plain'] / max(traffic['cross'], 1.0):.1f}x less)"
        )
    return line
