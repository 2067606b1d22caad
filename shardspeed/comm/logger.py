"""The comms logger: latency and bandwidth of profiled collectives (``comms_logger`` config).

Timing costs a device sync before and after each profiled op, so it only happens when the
logger is enabled. Bandwidths are in GB/s (10^9 bytes per second, as nccl-tests prints them):
``algbw = message bytes / latency`` and ``busbw = algbw * bus factor`` with the factors and
message-size conventions of :mod:`shardspeed.comm.volume`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardspeed.comm.volume import bus_factor
from shardspeed.utils.logging import log_dist

_KEYS = ("enabled", "verbose", "prof_all", "debug", "prof_ops")


@dataclass
class SizeStats:
    """Every profiled call of one op at one message size."""

    count: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    algbw_gbps: list[float] = field(default_factory=list)
    busbw_gbps: list[float] = field(default_factory=list)


class CommsLogger:
    """Which ops to time, and what was measured (record name -> message size -> stats)."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.debug = False
        self.prof_ops: list[str] = []
        self.comms_dict: dict[str, dict[int, SizeStats]] = {}

    def configure(
        self,
        enabled: bool | None = None,
        prof_all: bool | None = None,
        prof_ops: list[str] | None = None,
        verbose: bool | None = None,
        debug: bool | None = None,
    ) -> None:
        """Change the given settings; None leaves a setting as it is."""
        if enabled is not None:
            self.enabled = bool(enabled)
        if prof_all is not None:
            self.prof_all = bool(prof_all)
        if prof_ops is not None:
            self.prof_ops = list(prof_ops)
        if verbose is not None:
            self.verbose = bool(verbose)
        if debug is not None:
            self.debug = bool(debug)

    def should_profile(self, op: str, log_name: str, prof: bool) -> bool:
        """Whether this call is timed: logging on and the op selected (or forced with ``prof``)."""
        if not self.enabled:
            return False
        return self.prof_all or prof or log_name in self.prof_ops or op in self.prof_ops

    def append(
        self, op: str, record_name: str, latency_ms: float, msg_size: int, group_size: int
    ) -> None:
        """Store one timed call of ``op`` under ``record_name``."""
        seconds = max(latency_ms, 1e-9) / 1e3
        algbw = msg_size / seconds / 1e9
        busbw = algbw * bus_factor(op, group_size)
        stats = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, SizeStats())
        stats.count += 1
        stats.latencies_ms.append(latency_ms)
        stats.algbw_gbps.append(algbw)
        stats.busbw_gbps.append(busbw)
        if self.verbose:
            log_dist(
                f"comm op: {record_name} | time (ms): {latency_ms:.3f} | msg size: "
                f"{format_size(msg_size)} | algbw (GB/s): {algbw:.3f} | busbw (GB/s): {busbw:.3f}",
                ranks=[0],
            )

    def reset(self) -> None:
        """Forget every measurement (settings stay)."""
        self.comms_dict.clear()

    def operation_count(self) -> int:
        """Number of timed calls over all ops and sizes."""
        return sum(s.count for sizes in self.comms_dict.values() for s in sizes.values())

    def logged_ops(self) -> dict[str, dict[int, dict[str, Any]]]:
        """A plain-dict copy of the measurements: name -> size -> {count, latencies_ms, ...}."""
        return {
            name: {
                size: {
                    "count": s.count,
                    "latencies_ms": list(s.latencies_ms),
                    "algbw_gbps": list(s.algbw_gbps),
                    "busbw_gbps": list(s.busbw_gbps),
                }
                for size, s in sizes.items()
            }
            for name, sizes in self.comms_dict.items()
        }

    def format_summary(self, stragglers: dict[tuple[str, int], float] | None = None) -> str:
        """The summary table; ``stragglers`` adds a column of time spent waiting for peers."""
        headers = ["Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)"]
        headers += ["algbw (GB/s)", "busbw (GB/s)"]
        if stragglers is not None:
            headers.append("Straggler(ms)")
        widths = [14, 8, 18, 16, 13, 13, 14]
        lines = [
            "Comm. Op".ljust(20)
            + "".join(h.rjust(w) for h, w in zip(headers, widths, strict=False))
        ]
        for name in sorted(self.comms_dict):
            lines.append(name)
            for size in sorted(self.comms_dict[name]):
                s = self.comms_dict[name][size]
                total = sum(s.latencies_ms)
                cells = [format_size(size), str(s.count), f"{total:.3f}", f"{total / s.count:.3f}"]
                cells += [f"{_mean(s.algbw_gbps):.3f}", f"{_mean(s.busbw_gbps):.3f}"]
                if stragglers is not None:
                    cells.append(f"{stragglers.get((name, size), 0.0):.3f}")
                lines.append(
                    " " * 20 + "".join(c.rjust(w) for c, w in zip(cells, widths, strict=False))
                )
        return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def format_size(nbytes: int) -> str:
    """``nbytes`` with a binary unit, e.g. ``4.0 KB``."""
    value = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


# One logger per process, matching the single ``comms_logger`` section of a config.
_COMMS_LOGGER = CommsLogger()


def comms_logger() -> CommsLogger:
    """The process's comms logger."""
    return _COMMS_LOGGER


def _section_values(config: Any) -> dict[str, Any]:
    """Settings from a ``comms_logger`` section: a pydantic/attribute object or a dict.

    A whole config (dict with a ``comms_logger`` key, or an object with a ``comms_logger`` /
    ``comms_config`` attribute) is unwrapped to its section first.
    """
    if isinstance(config, Mapping):
        section = config.get("comms_logger", config)
        if not isinstance(section, Mapping):
            return _section_values(section)
        for key in section:
            if key not in _KEYS:
                close = difflib.get_close_matches(str(key), _KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {_KEYS}"
                raise ValueError(f"unknown comms_logger key {key!r}{hint}")
        return {k: section[k] for k in _KEYS if k in section}
    for wrapper in ("comms_logger", "comms_config"):
        inner = getattr(config, wrapper, None)
        if inner is not None:
            return _section_values(inner)
    return {k: getattr(config, k) for k in _KEYS if hasattr(config, k)}


def configure(
    config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
    *,
    deepspeed_config: Any = None,
) -> None:
    """Set up comms logging from a ``comms_logger`` section and/or keyword overrides.

    ``config`` (or DeepSpeed's keyword name ``deepspeed_config``) may be the pydantic section
    object, a whole config object holding it, or the equivalent dict. Keywords win over it.
    """
    source = config if config is not None else deepspeed_config
    values = _section_values(source) if source is not None else {}
    overrides = dict(
        enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    _COMMS_LOGGER.configure(**values)


def _straggler_times(logger: CommsLogger) -> dict[tuple[str, int], float]:
    # Each call's fastest rank arrived last, so (my latency - the fastest latency) is the time
    # this rank waited for others. Gathering lists as objects copes with ranks that logged
    # different numbers of calls (point-to-point ops).
    mine = {
        (n, s): st.latencies_ms for n, sizes in logger.comms_dict.items() for s, st in sizes.items()
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result: dict[tuple[str, int], float] = {}
    for key, lats in mine.items():
        waited = 0.0
        for i, lat in enumerate(lats):
            peers = [other[key][i] for other in everyone if key in other and i < len(other[key])]
            waited += lat - min(peers)
        result[key] = waited
    return result


def log_summary(show_straggler: bool = False) -> str | None:
    """Print the comms table on rank 0 and return it there (None elsewhere).

    With ``show_straggler`` every rank must call this, since it gathers latencies from all.
    """
    initialized = dist.is_available() and dist.is_initialized()
    stragglers = _straggler_times(_COMMS_LOGGER) if show_straggler and initialized else None
    if initialized and dist.get_rank() != 0:
        return None
    text = _COMMS_LOGGER.format_summary(stragglers)
    print(text, flush=True)
    return text


def reset_log() -> None:
    """Forget every measurement."""
    _COMMS_LOGGER.reset()


def has_comm_data() -> bool:
    """Whether any op has been timed since the last reset."""
    return bool(_COMMS_LOGGER.comms_dict)


def get_comm_operation_count() -> int:
    """Number of timed calls since the last reset."""
    return _COMMS_LOGGER.operation_count()


def get_logged_comm_ops() -> dict[str, dict[int, dict[str, Any]]]:
    """The measurements as plain dicts (see :meth:`CommsLogger.logged_ops`)."""
    return _COMMS_LOGGER.logged_ops()
