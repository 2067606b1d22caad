"""The package logger and rank-aware logging helpers.

This module sits at the bottom layer, so it cannot ask ``shardspeed.comm`` for the rank; the comm
layer registers a rank provider with :func:`set_rank_provider` once the process group exists.
Before that, the launcher's ``RANK`` environment variable is used.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable

LOG_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


def _create_logger(name: str = "shardspeed") -> logging.Logger:
    log = logging.getLogger(name)
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
    log.setLevel(os.environ.get("SHARDSPEED_LOG_LEVEL", "INFO").upper())
    log.propagate = False
    return log


logger = _create_logger()


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


_rank_provider: Callable[[], int] = _env_rank


def set_rank_provider(provider: Callable[[], int] | None) -> None:
    """Let the comm layer tell this module the global rank (``None`` restores the env fallback)."""
    global _rank_provider
    _rank_provider = provider or _env_rank


def current_rank() -> int:
    return _rank_provider()


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given global ranks (all ranks when ``ranks`` is None or has -1)."""
    rank = current_rank()
    wanted = None if ranks is None else set(ranks)
    if wanted is None or -1 in wanted or rank in wanted:
        logger.log(level, f"[Rank {rank}] {message}")


_warned: set[str] = set()


def warning_once(message: str) -> None:
    """Log a warning the first time ``message`` is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
