"""Coalesced collectives: many tensors, one collective over a flat buffer.

One big message amortises the per-collective latency; the price is a copy in and out. Tensors
of different dtypes cannot share a buffer, so each dtype gets its own collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from shardspeed.comm.instrument import DeferredWork, group_size, run_op, total_nbytes
from shardspeed.comm.torch_compat import all_gather_single

Group = Any


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    positions: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        positions.setdefault(t.dtype, []).append(i)
    return positions


def _finish(works: list[Any], copy_backs: list[Callable[[], None]], async_op: bool) -> Any:
    def copy_all() -> None:
        for copy_back in copy_backs:
            copy_back()

    if async_op:
        return DeferredWork(works, copy_all)
    copy_all()
    return None


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce_coalesced",
    debug: str | None = None,
) -> Any:
    """All-reduce every tensor in ``tensors`` in place, with one collective per dtype."""

    def call() -> Any:
        works, copy_backs = [], []
        for indices in _by_dtype(tensors).values():
            members = [tensors[i] for i in indices]
            flat = torch.cat([t.reshape(-1) for t in members])
            works.append(dist.all_reduce(flat, op=op, group=group, async_op=async_op))
            copy_backs.append(_unflatten_into(flat, members))
        return _finish(works, copy_backs, async_op)

    return run_op(
        "all_reduce_coalesced",
        call,
        msg_bytes=total_nbytes(tensors),
        group=group,
        async_op=async_op,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )


def _unflatten_into(flat: torch.Tensor, targets: list[torch.Tensor]) -> Callable[[], None]:
    def copy_back() -> None:
        for target, piece in zip(targets, flat.split([t.numel() for t in targets]), strict=True):
            target.copy_(piece.view_as(target))

    return copy_back


def all_gather_coalesced(
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: Group = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_coalesced",
    debug: str | None = None,
) -> Any:
    """``all_gather_into_tensor(output_tensors[i], input_tensors[i])`` for every i, in one
    collective per dtype (each output holds world_size copies of its input's size, rank order).
    """
    if len(output_tensors) != len(input_tensors):
        raise ValueError(
            f"all_gather_coalesced needs one output per input, got {len(output_tensors)} outputs "
            f"for {len(input_tensors)} inputs"
        )

    def call() -> Any:
        world = group_size(group)
        works, copy_backs = [], []
        for indices in _by_dtype(input_tensors).values():
            inputs = [input_tensors[i] for i in indices]
            outputs = [output_tensors[i] for i in indices]
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            gathered = torch.empty(
                world * flat_in.numel(), dtype=flat_in.dtype, device=flat_in.device
            )
            works.append(all_gather_single(gathered, flat_in, group=group, async_op=async_op))
            copy_backs.append(_scatter_gathered(gathered, world, inputs, outputs))
        return _finish(works, copy_backs, async_op)

    return run_op(
        "all_gather_coalesced",
        call,
        msg_bytes=total_nbytes(output_tensors),
        group=group,
        async_op=async_op,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )


def _scatter_gathered(
    gathered: torch.Tensor, world: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> Callable[[], None]:
    # gathered is [world, sum(numel)]: rank r's row holds every input of rank r back to back
    def copy_back() -> None:
        rows = gathered.view(world, -1)
        offset = 0
        for inp, out in zip(inputs, outputs, strict=True):
            n = inp.numel()
            out.view(world, n).copy_(rows[:, offset : offset + n])
            offset += n

    return copy_back
