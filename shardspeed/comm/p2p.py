"""Point-to-point transfers and barriers, counted like the collectives."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.comm.instrument import nbytes, run_op

Group = Any


def send(
    tensor: torch.Tensor,
    dst: int,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: str | None = None,
) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocks until it is handed over)."""
    run_op(
        "send",
        lambda: dist.send(tensor, dst, group=group, tag=tag),
        msg_bytes=nbytes(tensor),
        group=group,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: str | None = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); returns the sender."""
    return run_op(
        "recv",
        lambda: dist.recv(tensor, src, group=group, tag=tag),
        msg_bytes=nbytes(tensor),
        group=group,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )


def isend(
    tensor: torch.Tensor,
    dst: int,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: str | None = None,
) -> Any:
    """Start sending ``tensor`` to ``dst``; returns the work handle."""
    return run_op(
        "isend",
        lambda: dist.isend(tensor, dst, group=group, tag=tag),
        msg_bytes=nbytes(tensor),
        group=group,
        # timing an isend means waiting for the matching irecv, which the caller may post later
        async_op=False,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: str | None = None,
) -> Any:
    """Start receiving into ``tensor`` from ``src``; returns the work handle."""
    return run_op(
        "irecv",
        lambda: dist.irecv(tensor, src, group=group, tag=tag),
        msg_bytes=nbytes(tensor),
        group=group,
        async_op=False,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )


def barrier(
    group: Group = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: str | None = None,
) -> Any:
    """Wait until every rank of ``group`` reaches this call."""
    return run_op(
        "barrier",
        lambda: dist.barrier(group=group, async_op=async_op, device_ids=device_ids),
        msg_bytes=0,
        group=group,
        async_op=async_op,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )


def monitored_barrier(
    group: Group = None,
    timeout: timedelta | None = None,
    wait_all_ranks: bool = False,
    prof: bool = False,
    log_name: str = "monitored_barrier",
    debug: str | None = None,
) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout`` (gloo only)."""
    run_op(
        "monitored_barrier",
        lambda: dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks),
        msg_bytes=0,
        group=group,
        log_name=log_name,
        prof=prof,
        debug=debug,
    )
