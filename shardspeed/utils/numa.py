"""DeepSpeed's ``deepspeed.utils.numa``: core-list parsing for the launcher's core binding."""

from __future__ import annotations

__all__ = ["parse_range", "parse_range_list"]


def parse_range(rng: str) -> range:
    """``"3"`` -> ``range(3, 4)``; ``"2-5"`` -> ``range(2, 6)`` (both ends included)."""
    first, dash, last = rng.partition("-")
    try:
        low = int(first)
        high = int(last) if dash else low
    except ValueError:
        raise ValueError(
            f"Bad range: {rng!r}; write a number or two numbers joined by a dash, e.g. '2-5'"
        ) from None
    if high < low:
        raise ValueError(f"Bad range: {rng!r}; the end must not be below the start")
    return range(low, high + 1)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``: comma-separated numbers and ranges, each above the
    one before (no overlap, ascending), no spaces; ``ValueError`` otherwise."""
    numbers: list[int] = []
    for part in range_str.split(","):
        block = parse_range(part)
        if numbers and block[0] <= numbers[-1]:
            raise ValueError(
                f"Bad range: {range_str!r}; sub-ranges must ascend and must not overlap "
                f"({part!r} starts at or below {numbers[-1]})"
            )
        numbers.extend(block)
    return numbers
