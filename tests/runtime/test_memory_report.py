"""see_memory_usage: logs host and device memory only when forced, and returns the figures."""

from __future__ import annotations

import logging

import torch

from shardspeed.runtime.utils import see_memory_usage
from shardspeed.utils.logging import logger


def test_see_memory_usage_reports_when_forced(caplog) -> None:
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="shardspeed"):
            assert see_memory_usage("quiet") is None
            before = see_memory_usage("before alloc", force=True)
            block = torch.ones(64 * 2**20 // 4)  # 64 MiB that must show up in the process RSS
            report = see_memory_usage("after alloc", force=True)
    finally:
        logger.propagate = False
    assert report is not None and "quiet" not in caplog.text
    assert "after alloc" in caplog.text and "CPU Virtual Memory" in caplog.text
    assert before is not None
    # the figure is the live process RSS: it grows by the block just written (minus slack)
    grown = (report["process_rss_gb"] - before["process_rss_gb"]) * 2**30
    assert grown > 0.9 * block.numel() * 4, grown
    assert 0 < report["cpu_percent"] <= 100
    assert {"device_allocated_gb", "device_max_allocated_gb", "device_reserved_gb"} <= set(report)
