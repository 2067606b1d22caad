"""DeepSpeed's ``deepspeed.runtime.utils``: ``see_memory_usage`` (a one-line report of host and
device memory), ``set_random_seed`` and ``move_to_device``."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import numpy
import psutil
import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.utils.logging import logger

_GIB = 2**30


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (every device)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def move_to_device(
    item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool]
) -> Any:
    """Move every object in ``item`` (nested lists, tuples, dicts) for which ``criterion_func``
    holds to ``device`` by swapping its storage (``.data``), so the tensor object itself, and
    every reference to it, moves; containers are rebuilt, other objects returned unchanged."""
    if criterion_func(item):
        item.data = item.data.to(device)
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def memory_report() -> dict[str, float]:
    """Device memory allocated / peak / reserved and host (virtual) memory in use, in GiB."""
    accel = get_accelerator()
    vm = psutil.virtual_memory()
    return {
        "device_allocated_gb": accel.memory_allocated() / _GIB,
        "device_max_allocated_gb": accel.max_memory_allocated() / _GIB,
        "device_reserved_gb": accel.memory_reserved() / _GIB,
        "cpu_used_gb": (vm.total - vm.available) / _GIB,
        "cpu_percent": float(vm.percent),
        "process_rss_gb": psutil.Process().memory_info().rss / _GIB,
    }


def see_memory_usage(message: str, force: bool = False) -> dict[str, float] | None:
    """Log ``message`` with the current memory figures (only when ``force``, as in DeepSpeed)."""
    if not force:
        return None
    gc.collect()
    report = memory_report()
    logger.info(
        f"{message} | MA {report['device_allocated_gb']:.2f} GB "
        f"Max_MA {report['device_max_allocated_gb']:.2f} GB "
        f"CA {report['device_reserved_gb']:.2f} GB | "
        f"CPU Virtual Memory: used = {report['cpu_used_gb']:.2f} GB, percent = {report['cpu_percent']}% "
        f"| RSS {report['process_rss_gb']:.2f} GB"
    )
    get_accelerator().reset_peak_memory_stats()
    return report
