"""``shardspeed.comm``: DeepSpeed's torch.distributed-compatible communication API.

This package is the only importer of ``torch.distributed`` in shardspeed. Besides the
collectives it offers comms logging (``configure`` / ``log_summary``), an always-on byte
counter (``get_comm_volume`` / ``reset_comm_volume``) and :class:`Topology`, the named-axis rank
grid that hands out process groups.
"""

from torch.distributed import ProcessGroup, ReduceOp

from shardspeed.comm.cloud_env import (
    in_aml,
    in_aws_sm,
    in_dlts,
    patch_aml_env_for_torch_nccl_backend,
    patch_aws_sm_env_for_torch_nccl_backend,
)
from shardspeed.comm.coalesced import all_gather_coalesced, all_reduce_coalesced
from shardspeed.comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    allgather_fn,
    broadcast,
    broadcast_object_list,
    gather,
    inference_all_reduce,
    reduce,
    reduce_scatter,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    scatter,
)
from shardspeed.comm.discovery import (
    TORCH_DISTRIBUTED_DEFAULT_PORT,
    RankInfo,
    discover_rank_info,
    expand_nodelist,
)
from shardspeed.comm.logger import (
    configure,
    get_comm_operation_count,
    get_logged_comm_ops,
    has_comm_data,
    log_summary,
    reset_log,
)
from shardspeed.comm.p2p import barrier, irecv, isend, monitored_barrier, recv, send
from shardspeed.comm.state import (
    SUPPORTED_BACKENDS,
    available_backends,
    default_pg_timeout,
    destroy_process_group,
    enable_symm_mem_for_group,
    get_all_ranks_from_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    has_all_gather_into_tensor,
    has_all_reduce_coalesced,
    has_coalescing_manager,
    has_reduce_scatter_tensor,
    host_group,
    init_distributed,
    initialize_mesh_device,
    is_available,
    is_initialized,
    mpi_discovery,
    new_group,
    new_host_group,
    set_backend,
)
from shardspeed.comm.topology import Topology
from shardspeed.comm.volume import bus_factor, get_comm_volume, reset_comm_volume

# DeepSpeed's backend name constants (deepspeed/comm/constants.py)
NCCL_BACKEND = "nccl"
CCL_BACKEND = "ccl"
MPI_BACKEND = "mpi"
GLOO_BACKEND = "gloo"
SCCL_BACKEND = "sccl"
HCCL_BACKEND = "hccl"

__all__ = [
    "CCL_BACKEND",
    "GLOO_BACKEND",
    "HCCL_BACKEND",
    "MPI_BACKEND",
    "NCCL_BACKEND",
    "SCCL_BACKEND",
    "SUPPORTED_BACKENDS",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "ProcessGroup",
    "RankInfo",
    "ReduceOp",
    "Topology",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "bus_factor",
    "configure",
    "default_pg_timeout",
    "destroy_process_group",
    "discover_rank_info",
    "enable_symm_mem_for_group",
    "expand_nodelist",
    "gather",
    "get_all_ranks_from_group",
    "get_comm_operation_count",
    "get_comm_volume",
    "get_global_rank",
    "get_local_rank",
    "get_logged_comm_ops",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
    "inference_all_reduce",
    "init_distributed",
    "initialize_mesh_device",
    "irecv",
    "available_backends",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "mpi_discovery",
    "host_group",
    "new_group",
    "new_host_group",
    "patch_aml_env_for_torch_nccl_backend",
    "patch_aws_sm_env_for_torch_nccl_backend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reset_comm_volume",
    "reset_log",
    "scatter",
    "send",
    "set_backend",
]
