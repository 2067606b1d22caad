"""Module-level caches that hold process groups, dropped when the groups are destroyed.

A process group lives as long as anything refers to it. A cache that keeps one after
``destroy_process_group`` keeps gloo's worker threads running into interpreter shutdown, where
freeing the group can abort the process (SIGABRT, "terminate called without an active
exception") after the script has finished its work. Each cache registers how to empty itself
here; destroying every group empties them all first.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["forget_cached_groups", "register_group_cache"]

_CLEARERS: list[Callable[[], None]] = []


def register_group_cache(clear: Callable[[], None]) -> None:
    """Have ``clear`` (which empties one module's cache of groups) run when every group goes."""
    _CLEARERS.append(clear)


def forget_cached_groups() -> None:
    """Empty every registered cache, so that the groups they held can be freed."""
    for clear in _CLEARERS:
        clear()
