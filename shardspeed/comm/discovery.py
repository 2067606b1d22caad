"""Where this process sits in the job: rank, world size, local rank and the rendezvous address.

Everything here is a pure function of an environment mapping, so each launcher's conventions
can be tested without launching anything. Sources are tried in this order, and the first one
whose rank *and* size variables are both set wins:

1. ``launcher``: torchrun / the shardspeed launcher (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
2. ``openmpi``: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``
3. ``mvapich``: ``MV2_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``
4. ``pmi``: MPICH and Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``)
5. ``slurm``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` (run the ranks with ``srun``:
   a batch script's own shell also has these set and would wait for peers that never start)
6. ``single``: nothing set, so a one-process world (a plain ``python train.py``)

The MPI sources (2-4) are skipped when ``auto_mpi_discovery`` is False. Explicit ``rank`` /
``world_size`` arguments override what the source says. ``MASTER_ADDR`` / ``MASTER_PORT`` in the
environment always win; otherwise each source supplies its own guess (see :func:`discover`).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from typing import NamedTuple

DEFAULT_MASTER_ADDR = "127.0.0.1"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

_MPI_SOURCES = ("openmpi", "mvapich", "pmi")


class RankInfo(NamedTuple):
    """The answer of :func:`discover_rank_info`. ``master_addr`` is None when the source cannot
    know rank 0's host (multi-node MPI without ``MASTER_ADDR``); the caller must then ask MPI."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int


class _Source(NamedTuple):
    name: str
    rank: str
    size: str
    local_rank: tuple[str, ...]
    # variables holding "ranks on this node"; equal to the world size means single node
    local_size: tuple[str, ...]


_SOURCES: tuple[_Source, ...] = (
    _Source("launcher", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    _Source(
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    _Source(
        "mvapich",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        ("MV2_COMM_WORLD_LOCAL_RANK",),
        ("MV2_COMM_WORLD_LOCAL_SIZE",),
    ),
    _Source(
        "pmi",
        "PMI_RANK",
        "PMI_SIZE",
        ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
        ("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"),
    ),
    _Source("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ()),
)


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return _int_var(env, name)
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((DEFAULT_MASTER_ADDR, 0))
        return int(sock.getsockname()[1])


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as ``"node[01-03,07],login"`` into host names.

    Handles comma-separated entries, bracketed ranges that keep zero padding (``[08-10]``) and
    several bracket groups in one name (``rack[1-2]-n[1-2]``, expanded as a product).
    """
    hosts: list[str] = []
    for entry in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_entry(entry))
    return hosts


def _split_top_level(text: str) -> list[str]:
    # commas inside brackets separate ranges, not hosts
    entries, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    entries.append(text[start:])
    return [e.strip() for e in entries if e.strip()]


def _expand_entry(entry: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", entry)
    if match is None:
        return [entry]
    prefix, suffix = entry[: match.start()], entry[match.end() :]
    names: list[str] = []
    for part in match.group(1).split(","):
        low, _, high = part.strip().partition("-")
        if not high:
            names.append(low)
            continue
        width = len(low)
        names.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return [f"{prefix}{name}{rest}" for name in names for rest in _expand_entry(suffix)]


def _slurm_master(env: Mapping[str, str]) -> str | None:
    # Rank 0 runs on the first node of the step, so that host (not the node srun was typed on,
    # which may be a login node) is where the rendezvous store listens.
    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(var, "").strip():
            hosts = expand_nodelist(env[var])
            if hosts:
                return hosts[0]
    return env.get("SLURM_LAUNCH_NODE_IPADDR", "").strip() or None


def _find_source(env: Mapping[str, str], auto_mpi_discovery: bool) -> _Source | None:
    for source in _SOURCES:
        if source.name in _MPI_SOURCES and not auto_mpi_discovery:
            continue
        if env.get(source.rank, "").strip() and env.get(source.size, "").strip():
            return source
    return None


def discover(
    env: Mapping[str, str],
    rank: int = -1,
    world_size: int = -1,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    auto_mpi_discovery: bool = True,
    port_finder: Callable[[], int] = _free_port,
) -> tuple[str, RankInfo]:
    """Return ``(source name, RankInfo)`` for ``env`` (see the module docstring for the order).

    Master address when ``MASTER_ADDR`` is unset: ``127.0.0.1`` for the launcher source and for
    any single-node or one-rank world, the first Slurm step host for Slurm, None for multi-node
    MPI. Master port when ``MASTER_PORT`` is unset: ``distributed_port``, except a one-rank
    world, which takes a free port (``port_finder``) so two plain scripts do not collide.
    """
    source = _find_source(env, auto_mpi_discovery)
    if source is None:
        explicit = rank >= 0 or world_size > 0
        name, found_rank, found_size = ("explicit" if explicit else "single"), 0, 1
        local_rank = _first_int(env, ("LOCAL_RANK",))
        local_size = _first_int(env, ("LOCAL_WORLD_SIZE",))
    else:
        name = source.name
        found_rank, found_size = _int_var(env, source.rank), _int_var(env, source.size)
        local_rank = _first_int(env, source.local_rank)
        local_size = _first_int(env, source.local_size)

    final_rank = rank if rank >= 0 else found_rank
    final_size = world_size if world_size > 0 else found_size
    if not 0 <= final_rank < final_size:
        raise ValueError(
            f"rank {final_rank} is outside world size {final_size} (from {name}); "
            "pass rank in [0, world_size) or fix the launcher environment"
        )
    if local_rank is None:
        # no local rank given: assume one node, where local and global ranks coincide
        local_rank = final_rank % local_size if local_size else final_rank

    master_addr = env.get("MASTER_ADDR", "").strip() or None
    if master_addr is None:
        single_node = final_size == 1 or local_size == final_size
        if name == "slurm":
            master_addr = _slurm_master(env) or (DEFAULT_MASTER_ADDR if single_node else None)
        elif name in _MPI_SOURCES and not single_node:
            master_addr = None
        else:
            master_addr = DEFAULT_MASTER_ADDR

    port_value = env.get("MASTER_PORT", "").strip()
    if port_value:
        master_port = _int_var(env, "MASTER_PORT")
    elif final_size == 1:
        master_port = port_finder()
    else:
        master_port = distributed_port
    return name, RankInfo(final_rank, final_size, local_rank, master_addr, master_port)


def discover_rank_info(
    env: Mapping[str, str],
    rank: int = -1,
    world_size: int = -1,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    auto_mpi_discovery: bool = True,
    port_finder: Callable[[], int] = _free_port,
) -> RankInfo:
    """:func:`discover` without the source name."""
    return discover(env, rank, world_size, distributed_port, auto_mpi_discovery, port_finder)[1]


def rank_info_env(info: RankInfo) -> dict[str, str]:
    """The variables DeepSpeed exports once the rank is known (torch's ``env://`` reads them)."""
    exported = {
        "RANK": str(info.rank),
        "LOCAL_RANK": str(info.local_rank),
        "WORLD_SIZE": str(info.world_size),
        "MASTER_PORT": str(info.master_port),
    }
    if info.master_addr is not None:
        exported["MASTER_ADDR"] = info.master_addr
    return exported
