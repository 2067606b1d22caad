"""Elementwise CPU optimizer updates over cache-sized blocks, spread over worker threads.

An update made of several elementwise passes (``torch._foreach_*`` kernels) reads and writes
every tensor once per pass. Run over flat blocks of ~1M elements instead, all passes of a block
work on a few MB that stay in cache, so memory sees about one read and one write per tensor.

Each block is a separate set of small kernels; run on PyTorch's intra-op threads, each kernel
would end in a barrier between the threads, and on a machine whose cores are shared a barrier
waits for a descheduled thread (a few ms, every kernel). So the blocks are handed out one at a
time to ``torch.get_num_threads()`` worker threads, each running its kernels single-threaded:
no barriers, and a thread that is descheduled just takes fewer blocks. While the update runs,
torch's intra-op thread count is 1 for the whole process (restored after): call it from the
thread that owns the training step, not beside other CPU compute.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["BLOCK_NUMEL", "blockable", "flat_blocks", "run_blocks"]

#: elements per block (4 MB of fp32 per tensor)
BLOCK_NUMEL = 1 << 20

Block = list[tuple[torch.Tensor, ...]]

_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def blockable(*tensors: torch.Tensor | None) -> bool:
    """Whether these tensors (one parameter's) can be cut into aligned flat blocks."""
    return all(
        t is not None and not t.is_sparse and t.device.type == "cpu" and t.is_contiguous()
        for t in tensors
    )


def flat_blocks(rows: Sequence[Sequence[torch.Tensor]], limit: int | None = None) -> list[Block]:
    """Rows of same-size tensors (one row per parameter: e.g. param, grad, moment) as blocks:
    lists of aligned flat views of at most ``limit`` elements in all (default BLOCK_NUMEL).
    The first tensor of a row sets its size; a 0-d tensor in a row (e.g. the parameter's step)
    is passed whole with every piece of that row."""
    limit = BLOCK_NUMEL if limit is None else limit
    blocks: list[Block] = []
    current: Block = []
    size = 0
    for row in rows:
        parts = [t.detach().view(-1).split(limit) if t.dim() else itertools.repeat(t) for t in row]
        for piece in zip(*parts, strict=False):  # 0-d members repeat without end
            if current and size + piece[0].numel() > limit:
                blocks.append(current)
                current, size = [], 0
            current.append(piece)
            size += piece[0].numel()
    if current:
        blocks.append(current)
    return blocks


def run_blocks(blocks: Sequence[Block], update: Callable[[Block], None]) -> None:
    """``update(block)`` for every block, on ``torch.get_num_threads()`` threads (see module)."""
    threads = torch.get_num_threads()
    if threads <= 1 or len(blocks) <= 1:
        for block in blocks:
            update(block)
        return
    queue: Iterator[Block] = iter(blocks)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                block = next(queue, None)
            if block is None:
                return
            update(block)

    torch.set_num_threads(1)
    try:
        futures = [_pool(threads).submit(worker) for _ in itertools.repeat(None, threads)]
        for future in futures:
            future.result()  # re-raises a worker's error
    finally:
        torch.set_num_threads(threads)


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = ThreadPoolExecutor(threads, thread_name_prefix="shardspeed-optim")
            _pools[threads] = pool
        return pool
