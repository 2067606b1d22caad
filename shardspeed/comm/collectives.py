"""Collectives with torch.distributed's semantics, counted and optionally timed.

Each function takes the arguments of its ``torch.distributed`` namesake plus DeepSpeed's
``prof`` (time this call even if not selected in ``prof_ops``), ``log_name`` (the name it is
logged under) and ``debug`` (caller name for the log; found automatically when None).
``group=None`` means the world group. With ``async_op=True`` the torch work handle is returned.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from shardspeed.comm.gloo_paths import (
    all_gather_by_broadcast,
    reduce_scatter_by_send_recv,
    use_broadcast_all_gather,
    use_send_recv_reduce_scatter,
)
from shardspeed.comm.instrument import DeferredWork, group_size, nbytes, run_op, total_nbytes
from shardspeed.comm.torch_compat import all_gather_single, reduce_scatter_single

Group = Any  # a ProcessGroup or None (world)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug: str | None = None,
) -> Any:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``."""
    return run_op(
        "broadcast",
        lambda: dist.broadcast(tensor, src, group=group, async_op=async_op),
        msg_bytes=nbytes(tensor),
        **_log(group, async_op, log_name, prof, debug),
    )


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Any:
    """Reduce ``tensor`` across ``group`` in place, every rank getting the result."""
    return run_op(
        "all_reduce",
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        msg_bytes=nbytes(tensor),
        **_log(group, async_op, log_name, prof, debug),
    )


def inference_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "inference_all_reduce",
    debug: str | None = None,
) -> Any:
    """DeepSpeed's low-latency all-reduce for inference; here the ordinary all-reduce."""
    return run_op(
        "inference_all_reduce",
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        msg_bytes=nbytes(tensor),
        **_log(group, async_op, log_name, prof, debug),
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug: str | None = None,
) -> Any:
    """Reduce ``tensor`` across ``group`` into global rank ``dst``."""
    return run_op(
        "reduce",
        lambda: dist.reduce(tensor, dst, op=op, group=group, async_op=async_op),
        msg_bytes=nbytes(tensor),
        **_log(group, async_op, log_name, prof, debug),
    )


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug: str | None = None,
) -> Any:
    """Gather every rank's ``tensor`` into ``tensor_list`` (one entry per rank)."""
    return run_op(
        "all_gather",
        lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op),
        msg_bytes=total_nbytes(tensor_list),
        **_log(group, async_op, log_name, prof, debug),
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
    debug: str | None = None,
) -> Any:
    """Gather every rank's ``tensor`` into ``output_tensor``, concatenated in rank order.

    ``tensor`` may be this rank's chunk of ``output_tensor`` (in place). On gloo with CPU tensors
    this runs as one broadcast per rank (see :mod:`shardspeed.comm.gloo_paths`): the same bytes,
    about 3x faster than gloo's own and with no staging buffer."""
    if use_broadcast_all_gather(output_tensor, tensor, group):
        call = lambda: all_gather_by_broadcast(output_tensor, tensor, group, async_op)  # noqa: E731
    else:
        call = lambda: all_gather_single(output_tensor, tensor, group=group, async_op=async_op)  # noqa: E731
    return run_op(
        "all_gather_into_tensor",
        call,
        msg_bytes=nbytes(output_tensor),
        **_log(group, async_op, log_name, prof, debug),
    )


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    debug: str | None = None,
) -> Any:
    """DeepSpeed's helper name for :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(
        output_tensor, input_tensor, group=group, async_op=async_op, debug=debug
    )


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter",
    debug: str | None = None,
) -> Any:
    """Reduce ``input_list`` element-wise across ranks; rank i receives entry i in ``output``."""
    return run_op(
        "reduce_scatter",
        lambda: dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op),
        msg_bytes=total_nbytes(input_list),
        **_log(group, async_op, log_name, prof, debug),
    )


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug: str | None = None,
) -> Any:
    """Reduce ``tensor`` across ranks; rank i receives the i-th equal chunk in ``output_tensor``.

    ``output_tensor`` may be this rank's chunk of ``tensor`` (in place). On gloo with CPU tensors
    this runs as point-to-point sends plus a local reduction (see
    :mod:`shardspeed.comm.gloo_paths`): the same bytes, about 3x faster than gloo's own."""
    if use_send_recv_reduce_scatter(tensor, op, group):
        call = lambda: reduce_scatter_by_send_recv(output_tensor, tensor, op, group, async_op)  # noqa: E731
    else:
        call = lambda: reduce_scatter_single(  # noqa: E731
            output_tensor, tensor, op=op, group=group, async_op=async_op
        )
    return run_op(
        "reduce_scatter_tensor",
        call,
        msg_bytes=nbytes(tensor),
        **_log(group, async_op, log_name, prof, debug),
    )


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    debug: str | None = None,
) -> Any:
    """DeepSpeed's helper name for :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(
        output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof, debug=debug
    )


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug: str | None = None,
) -> Any:
    """Split ``tensor`` along dim 0, send split i to rank i, concatenate what arrives in ``output``."""
    return run_op(
        "all_to_all_single",
        lambda: dist.all_to_all_single(
            output,
            tensor,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
        ),
        msg_bytes=nbytes(tensor),
        **_log(group, async_op, log_name, prof, debug),
    )


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all",
    debug: str | None = None,
) -> Any:
    """Send ``input_tensor_list[i]`` to rank i; receive rank i's into ``output_tensor_list[i]``."""
    return run_op(
        "all_to_all",
        lambda: _all_to_all(output_tensor_list, input_tensor_list, group, async_op),
        msg_bytes=total_nbytes(input_tensor_list),
        **_log(group, async_op, log_name, prof, debug),
    )


def _all_to_all(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: Group, async_op: bool
) -> Any:
    if dist.get_backend(group) != "gloo":
        return dist.all_to_all(outputs, inputs, group=group, async_op=async_op)
    # gloo has no list all_to_all; the single-tensor form over one flat buffer is equivalent
    flat_in = torch.cat([t.reshape(-1) for t in inputs])
    flat_out = torch.empty(
        sum(t.numel() for t in outputs), dtype=flat_in.dtype, device=flat_in.device
    )
    work = dist.all_to_all_single(
        flat_out,
        flat_in,
        output_split_sizes=[t.numel() for t in outputs],
        input_split_sizes=[t.numel() for t in inputs],
        group=group,
        async_op=async_op,
    )

    def copy_back() -> None:
        for out, piece in zip(outputs, flat_out.split([t.numel() for t in outputs]), strict=True):
            out.copy_(piece.view_as(out))

    if async_op:
        return DeferredWork(work, copy_back)
    copy_back()
    return None


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "gather",
    debug: str | None = None,
) -> Any:
    """Collect every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    return run_op(
        "gather",
        lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op),
        # nccl-tests size for gather/scatter is the whole buffer at the root
        msg_bytes=nbytes(tensor) * max(group_size(group), 1),
        **_log(group, async_op, log_name, prof, debug),
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "scatter",
    debug: str | None = None,
) -> Any:
    """Send ``scatter_list[i]`` from global rank ``src`` into rank i's ``tensor``."""
    return run_op(
        "scatter",
        lambda: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op),
        msg_bytes=nbytes(tensor) * max(group_size(group), 1),
        **_log(group, async_op, log_name, prof, debug),
    )


def broadcast_object_list(
    object_list: list[Any], src: int, group: Group = None, device: torch.device | None = None
) -> None:
    """Pickle ``object_list`` on ``src`` and fill it on every rank (not counted: size unknown)."""
    dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> None:
    """Fill ``object_list[i]`` with rank i's ``obj`` (not counted: size unknown before pickling)."""
    dist.all_gather_object(object_list, obj, group=group)


def _log(
    group: Group, async_op: bool, log_name: str, prof: bool, debug: str | None
) -> dict[str, Any]:
    return {
        "group": group,
        "async_op": async_op,
        "log_name": log_name,
        "prof": prof,
        "debug": debug,
    }
