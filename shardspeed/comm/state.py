"""Process-group setup and the rank queries.

:func:`init_distributed` turns whatever launched this process (torchrun, MPI, Slurm, or nothing
at all) into an initialized default process group; see :mod:`shardspeed.comm.discovery`.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardspeed.accelerator import get_accelerator
from shardspeed.comm.cloud_env import (
    in_aml,
    in_aws_sm,
    in_dlts,
    patch_aml_env_for_torch_nccl_backend,
    patch_aws_sm_env_for_torch_nccl_backend,
)
from shardspeed.comm.discovery import (
    TORCH_DISTRIBUTED_DEFAULT_PORT,
    RankInfo,
    discover,
    rank_info_env,
)
from shardspeed.comm.group_caches import forget_cached_groups, register_group_cache
from shardspeed.comm.logger import configure
from shardspeed.utils.logging import logger, set_rank_provider

default_pg_timeout = timedelta(minutes=30)
TIMEOUT_ENV_VARS: tuple[str, ...] = ("SHARDSPEED_TIMEOUT", "DEEPSPEED_TIMEOUT")
SUPPORTED_BACKENDS: tuple[str, ...] = ("nccl", "gloo", "mpi", "ccl", "xccl", "hccl")

# backend chosen with set_backend() before init_distributed(); None = the accelerator's
_preferred_backend: str | None = None


def is_available() -> bool:
    """Whether this torch build has torch.distributed."""
    return dist.is_available()


def available_backends(
    names: tuple[str, ...] = ("nccl", "gloo", "mpi", "ucc", "xccl"),
) -> dict[str, bool]:
    """Which of ``names`` this torch build includes (``torch.distributed.is_<name>_available``)."""
    if not dist.is_available():
        return dict.fromkeys(names, False)
    probes = {name: getattr(dist, f"is_{name}_available", None) for name in names}
    return {name: bool(probe()) if probe is not None else False for name, probe in probes.items()}


def is_initialized() -> bool:
    """Whether the default process group exists (made by shardspeed or by anyone else)."""
    return dist.is_available() and dist.is_initialized()


def set_backend(backend: str | None = None) -> None:
    """Choose the torch.distributed backend the next :func:`init_distributed` uses."""
    global _preferred_backend
    if backend is not None and backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(SUPPORTED_BACKENDS)}")
    _preferred_backend = backend


def _timeout(timeout: timedelta) -> timedelta:
    if timeout is not default_pg_timeout:
        return timeout
    for var in TIMEOUT_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            try:
                return timedelta(minutes=float(value))
            except ValueError:
                raise ValueError(f"{var}={value!r} must be a number of minutes") from None
    return timeout


def _configure_logging(config: Any) -> None:
    # the whole DeepSpeed config may be passed; only its comms_logger section matters here
    if isinstance(config, Mapping):
        if "comms_logger" in config:
            configure(config["comms_logger"])
    elif hasattr(config, "comms_logger") or hasattr(config, "comms_config"):
        configure(config)


def _mpi_master_addr() -> str:
    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError(
            "multi-node MPI launch without MASTER_ADDR: export MASTER_ADDR=<rank 0's host> "
            "(e.g. mpirun -x MASTER_ADDR=...) or install mpi4py so rank 0's address can be shared"
        ) from None
    comm = MPI.COMM_WORLD
    addr = socket.gethostbyname(socket.gethostname()) if comm.Get_rank() == 0 else None
    return str(comm.bcast(addr, root=0))


def _patch_cloud_env() -> None:
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
        return
    if in_aml() and not in_dlts():
        patch_aml_env_for_torch_nccl_backend()
    elif in_aws_sm():
        patch_aws_sm_env_for_torch_nccl_backend()


def mpi_discovery(
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True
) -> RankInfo:
    """Read rank and size from the MPI launcher's environment and export torch's variables."""
    source, info = discover(os.environ, distributed_port=distributed_port)
    if info.master_addr is None:
        info = info._replace(master_addr=_mpi_master_addr())
    os.environ.update(rank_info_env(info))
    if verbose:
        logger.info(
            f"Discovered {source} environment: rank={info.rank} local_rank={info.local_rank} "
            f"world_size={info.world_size} master={info.master_addr}:{info.master_port}"
        )
    return info


# whether this process ever had a process group (the exit handler has nothing to do otherwise)
_had_groups = False


def _on_initialized() -> None:
    global _had_groups
    set_rank_provider(get_rank)
    _had_groups = True


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = default_pg_timeout,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group unless one exists.

    Rank information comes from, in order: ``rank`` / ``world_size``, the torchrun-style
    environment, OpenMPI, MVAPICH, MPICH/Intel MPI, Slurm, else a one-process world; the result
    is exported as ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
    The backend defaults to the accelerator's (gloo on CPU, nccl on CUDA). ``timeout`` defaults
    to ``SHARDSPEED_TIMEOUT`` / ``DEEPSPEED_TIMEOUT`` minutes when set, else 30 minutes.
    ``config`` (a DeepSpeed config dict or object) configures comms logging.
    """
    if config is not None:
        _configure_logging(config)
    if is_initialized():
        # someone (this function earlier, the user, a test harness) already made the group;
        # the exit handler still frees what shardspeed cached on it
        _on_initialized()
        return
    if dist_init_required is False:
        raise ValueError(
            "dist_init_required=False but no process group exists; call "
            "torch.distributed.init_process_group() first or pass dist_init_required=None"
        )
    backend = dist_backend or _preferred_backend or get_accelerator().communication_backend_name()
    if auto_mpi_discovery:
        _patch_cloud_env()
    source, info = discover(
        os.environ,
        rank=rank,
        world_size=world_size,
        distributed_port=distributed_port,
        auto_mpi_discovery=auto_mpi_discovery,
    )
    if info.master_addr is None and init_method is None:
        info = info._replace(master_addr=_mpi_master_addr())
    os.environ.update(rank_info_env(info))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        # NCCL binds a communicator to the current device, so pick this rank's GPU first
        accelerator.set_device(info.local_rank % max(accelerator.device_count(), 1))
    else:
        # host devices only record the slot; MPI launches learn their local rank just now
        accelerator.set_device(info.local_rank)
    if verbose and info.rank == 0:
        logger.info(
            f"Initializing torch.distributed: backend={backend} world_size={info.world_size} "
            f"(from {source}) master={info.master_addr}:{info.master_port}"
        )
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        timeout=_timeout(timeout),
        rank=info.rank,
        world_size=info.world_size,
    )
    _on_initialized()


def _drop_world_defaults() -> None:
    """Some torch modules bind ``group=group.WORLD`` as default arguments when imported
    (``torch.distributed.nn.functional``, which torch.optim imports lazily after init;
    ``ZeroRedundancyOptimizer``; FSDP's ``ShardedGradScaler``): imported after init, their
    functions hold the world group for good, so destroying the groups never frees it. Point
    such defaults of the loaded ``torch.distributed`` modules back to None (the world group,
    whichever is current), for their functions and their classes' ``__init__``."""
    with warnings.catch_warnings():  # looking at deprecated names (reduce_op) warns
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if module is not None and name.startswith("torch.distributed."):
                _drop_defaults_in(module)


def _drop_defaults_in(module: Any) -> None:
    """:func:`_drop_world_defaults` for one module."""
    for value in list(vars(module).values()):
        try:  # module contents are arbitrary objects: one that will not say is skipped
            function = getattr(value, "__init__", None) if isinstance(value, type) else value
            defaults = getattr(function, "__defaults__", None)
            if isinstance(defaults, tuple) and any(
                isinstance(d, dist.ProcessGroup) for d in defaults
            ):
                function.__defaults__ = tuple(  # type: ignore[union-attr]
                    None if isinstance(d, dist.ProcessGroup) else d for d in defaults
                )
        except Exception:  # noqa: BLE001, S112 - best effort, at exit or destroy
            continue


register_group_cache(_drop_world_defaults)


def _release_at_exit() -> None:
    """Free the process groups while the interpreter still runs (registered when this module
    is imported, so it runs after the exit handlers a script registers later: theirs may still
    use the groups, or destroy them themselves).

    Engines hold their process groups in reference cycles (hooks on parameters point back at
    the objects that own the groups), which Python may only collect during its own shutdown;
    a gloo group destroyed then can abort the process (SIGABRT, "terminate called without an
    active exception") after the script finished. Drop shardspeed's cached groups, collect
    those cycles and destroy the groups here, as a script that called
    ``destroy_process_group`` itself would have."""
    if not _had_groups:
        return
    # even when the script destroyed the groups itself: a destroyed group still referenced
    # is freed during shutdown all the same
    forget_cached_groups()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001 - exiting anyway: say why, do not mask
            logger.debug(f"destroying the process group at exit failed: {error}")


atexit.register(_release_at_exit)


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (and the host group :func:`host_group` made for it), or every group
    when None (after which ranks come from the env again)."""
    if group is None:
        forget_cached_groups()
    else:
        entry = _HOST_GROUPS.pop(id(group), None)
        if entry is not None and entry[0] is group and entry[1] not in (None, group):
            dist.destroy_process_group(entry[1])
    dist.destroy_process_group(group)
    if group is None:
        set_rank_provider(None)


def new_group(
    ranks: list[int], timeout: timedelta | None = None, backend: str | None = None
) -> Any:
    """A process group of global ``ranks``. Every rank of the world must make the same calls in
    the same order, members or not (torch's rule); non-members get a non-member handle."""
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend)


#: host (gloo) groups made for device groups, by the device group's id: (device group, host
#: group), the device group held so that its id is not reused while the entry lives
_HOST_GROUPS: dict[int, tuple[Any, Any]] = {}
register_group_cache(_HOST_GROUPS.clear)


def host_group(group: Any = None) -> Any:
    """A group of ``group``'s members whose collectives run on host tensors: ``group`` itself
    when its backend is gloo, otherwise a gloo group over the same ranks, made once. Every rank
    of the world must call it at the same point (each with its own group), as torch requires
    for making groups. Small control messages (ranks agreeing on what runs next) go through
    it, so checking them never waits for the device's stream."""
    _require_initialized("host_group")
    if dist.get_backend(group) == dist.Backend.GLOO:
        return group
    entry = _HOST_GROUPS.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _HOST_GROUPS[id(group)] = (group, new_host_group(get_all_ranks_from_group(group)))
    return entry[1]


def new_host_group(ranks: list[int]) -> Any:
    """A gloo group of global ``ranks`` (this rank's group). Every rank of the world calls it
    at the same point, each with the ranks of its own group: the ranks exchange their lists
    and every rank makes every distinct group in the same order (torch's rule for new_group),
    returning the one it belongs to."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(ranks))
    mine = None
    for members in sorted({tuple(r) for r in everyone}):
        made = dist.new_group(ranks=list(members), backend="gloo")
        if dist.get_rank() in members:
            mine = made
    return mine


def _require_initialized(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"shardspeed.comm.{what}() needs a process group; call "
            "shardspeed.comm.init_distributed() (or shardspeed.initialize) first"
        )


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (global rank when None); -1 when not a member."""
    _require_initialized("get_rank")
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (the world when None)."""
    _require_initialized("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher (or init_distributed) exported it."""
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        value = os.environ.get(var, "").strip()
        if value:
            return int(value)
    return 0


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    _require_initialized("get_global_rank")
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order."""
    _require_initialized("get_all_ranks_from_group")
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def get_world_group() -> Any:
    """The default (world) process group."""
    _require_initialized("get_world_group")
    return dist.group.WORLD


def initialize_mesh_device(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> Any:
    """A torch ``DeviceMesh`` of ``mesh_shape`` on the accelerator's device type."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        get_accelerator().device_name(), mesh_shape, mesh_dim_names=mesh_dim_names
    )


def enable_symm_mem_for_group(group_name: str) -> None:
    """Enable symmetric memory for a group on CUDA; no-op elsewhere (CPU has no such memory)."""
    if get_accelerator().device_name() != "cuda":
        return
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group as enable

    enable(group_name)  # type: ignore[arg-type]  # torch's GroupName is a NewType of str


def has_all_gather_into_tensor() -> bool:
    """True: every supported torch has ``all_gather_into_tensor``."""
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    """True: every supported torch has ``reduce_scatter_tensor``."""
    return hasattr(dist, "reduce_scatter_tensor")


def has_all_reduce_coalesced() -> bool:
    """True: :func:`shardspeed.comm.all_reduce_coalesced` works on every backend (flat buffer)."""
    return True


def has_coalescing_manager() -> bool:
    """Whether torch offers its (private) coalescing manager."""
    from torch.distributed import distributed_c10d

    return hasattr(distributed_c10d, "_coalescing_manager")
