"""Asynchronous tensor I/O to files (ZeRO-Infinity's NVMe swapping), in pure Python.

:class:`TensorSwapper` moves CPU tensors to and from one file per key under ``nvme_path``
with a thread pool of positioned reads and writes; see :mod:`shardspeed.runtime.swap.swapper`.
"""

from shardspeed.runtime.swap.aligned import ALIGNMENT, aligned_empty
from shardspeed.runtime.swap.errors import SwapError, SwapPathError
from shardspeed.runtime.swap.handle import SwapHandle
from shardspeed.runtime.swap.swapper import TensorSwapper

__all__ = [
    "ALIGNMENT",
    "SwapError",
    "SwapHandle",
    "SwapPathError",
    "TensorSwapper",
    "aligned_empty",
]
