"""Splitting a list of layers into contiguous stages: ``uniform`` (equal layer counts),
``parameters`` (balanced parameter counts) and ``type:<regex>`` (balanced counts of layers whose
class name matches). A partition is a list of ``stages + 1`` boundaries; stage ``s`` holds
layers ``parts[s] .. parts[s + 1] - 1``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving each part ``num_items // num_parts`` items, the first parts one more
    while items remain."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    parts = [0]
    for part in range(num_parts):
        parts.append(parts[-1] + size + (1 if part < extra else 0))
    return parts


def _fits(prefix: Sequence[float], num_parts: int, capacity: float) -> list[int] | None:
    """Greedy boundaries with no part heavier than ``capacity``, or None if it needs more
    parts. Each part takes at least one item while items remain."""
    num_items = len(prefix) - 1
    parts = [0]
    start = 0
    for _ in range(num_parts):
        end = start
        while end < num_items and (end == start or prefix[end + 1] - prefix[start] <= capacity):
            if end == start and prefix[end + 1] - prefix[start] > capacity:
                return None
            end += 1
        parts.append(end)
        start = end
    return parts if start == num_items else None


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous boundaries that minimise the heaviest part (binary search on its weight)."""
    num_items = len(weights)
    if num_items <= num_parts:
        return partition_uniform(num_items, num_parts)
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    low, high = max(float(w) for w in weights), prefix[-1]
    best = _fits(prefix, num_parts, high)
    assert best is not None
    for _ in range(64):
        if high - low <= 1e-9 * max(high, 1.0):
            break
        mid = (low + high) / 2
        found = _fits(prefix, num_parts, mid)
        if found is None:
            low = mid
        else:
            best, high = found, mid
    return _spread_empty(best, num_items)


def _spread_empty(parts: list[int], num_items: int) -> list[int]:
    """Move boundaries so that no part is empty while there are enough items (a greedy fill
    leaves the last parts empty when the last weights are zero)."""
    num_parts = len(parts) - 1
    parts[-1] = num_items
    for part in range(num_parts - 1, 0, -1):
        parts[part] = min(parts[part], parts[part + 1] - 1)
    for part in range(1, num_parts):
        parts[part] = max(parts[part], parts[part - 1] + 1)
    return parts
