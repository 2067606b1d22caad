"""The one path every collective takes: count its bytes, and time it when logging asks.

Counting is always on and costs a dict update. Timing syncs the device before and after the op,
and waits on an async op's handle, so a profiled async op is effectively synchronous: profiling
is for diagnosis, and an unwaited launch time would say nothing about the transfer.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.accelerator import get_accelerator
from shardspeed.comm.group_caches import register_group_cache
from shardspeed.comm.logger import comms_logger
from shardspeed.comm.volume import record_volume


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def total_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of all ``tensors`` together."""
    return sum(nbytes(t) for t in tensors)


def group_size(group: Any) -> int:
    """Ranks in ``group`` (None = world); 0 when this rank is not a member, so nothing counts."""
    if group is None:
        return dist.get_world_size()
    if dist.get_rank(group) < 0:
        return 0
    return dist.get_world_size(group)


#: (group id, ranks per node) -> (the group, whether its ranks sit on more than one node); the
#: group is held so that its id is not reused by another while the entry lives
_CROSSING: dict[tuple[int, int], tuple[Any, bool]] = {}
register_group_cache(_CROSSING.clear)


def crosses_nodes(group: Any) -> bool:
    """Whether ``group`` (None = world) holds ranks of more than one node, a node being
    ``LOCAL_WORLD_SIZE`` consecutive global ranks (unset: one node holds every rank)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    per_node = int(local) if local.isdigit() and int(local) > 0 else 0
    if per_node == 0:
        return False
    key = (id(group), per_node)
    entry = _CROSSING.get(key)
    if entry is None:
        ranks = (
            range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
        )
        entry = _CROSSING[key] = (group, len({rank // per_node for rank in ranks}) > 1)
    return bool(entry[1])


def _caller_name() -> str:
    # frame 0 is here, 1 run_op, 2 the shardspeed.comm function, 3 its caller
    frame = sys._getframe(3)
    return frame.f_code.co_name


def run_op(
    op: str,
    call: Callable[[], Any],
    *,
    msg_bytes: int,
    group: Any = None,
    async_op: bool = False,
    log_name: str | None = None,
    prof: bool = False,
    debug: str | None = None,
) -> Any:
    """Run ``call`` (the torch.distributed collective) and account for it as ``op``."""
    size = group_size(group)
    if size > 0:
        record_volume(op, msg_bytes, size, size > 1 and crosses_nodes(group))
    logger = comms_logger()
    name = log_name or op
    if size <= 0 or not logger.should_profile(op, name, prof):
        return call()
    accelerator = get_accelerator()
    accelerator.synchronize()
    start = time.perf_counter()
    result = call()
    if async_op and result is not None:
        result.wait()
    accelerator.synchronize()
    latency_ms = (time.perf_counter() - start) * 1e3
    if logger.debug:
        name = f"{name} | [Caller Func: {debug or _caller_name()}]"
    logger.append(op, name, latency_ms, msg_bytes, size)
    return result


class DeferredWork:
    """One handle for one or several works launched together, running ``on_complete`` (once)
    when they are done.

    Coalesced ops communicate one flat buffer and then copy results back into the caller's
    tensors; the gloo fast paths reduce what they received. With ``async_op`` that step must
    wait until the caller waits on the handle.
    """

    def __init__(self, works: Any, on_complete: Callable[[], None] | None = None) -> None:
        self._works = [w for w in (works if isinstance(works, list) else [works]) if w is not None]
        self._on_complete = on_complete

    def wait(self, timeout: Any = None) -> bool:
        """Wait for every op, then run the completion step (once)."""
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        self._works = []
        if self._on_complete is not None:
            finish, self._on_complete = self._on_complete, None
            finish()
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` has run."""
        return not self._works and self._on_complete is None
