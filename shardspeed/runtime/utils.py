"""``see_memory_usage``: a one-line report of host and device memory (DeepSpeed's name)."""

from __future__ import annotations

import gc

import psutil

from shardspeed.accelerator import get_accelerator
from shardspeed.utils.logging import logger

_GIB = 2**30


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
