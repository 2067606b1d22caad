"""Core binding for ``--bind_cores_to_rank``: split a core list evenly, one block per local rank.

Binding uses ``os.sched_setaffinity`` in the child before it starts, so it needs no ``numactl``.
"""

from __future__ import annotations

import os


def parse_core_list(spec: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``; ``ValueError`` names a bad token."""
    cores: list[int] = []
    hint = "write core ids and ranges like '0-3,8,10-11'"
    for token in spec.split(","):
        token = token.strip()
        first, dash, last = token.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(
                f"--bind_core_list {spec!r}: {token!r} is not a core id or range; {hint}"
            )
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"--bind_core_list {spec!r}: range {token!r} runs backwards; {hint}")
        for core in range(low, high + 1):
            if core in cores:
                raise ValueError(f"--bind_core_list {spec!r} lists core {core} twice; {hint}")
            cores.append(core)
    return cores


def available_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def split_cores(cores: list[int], num_ranks: int) -> list[list[int]]:
    """Equal contiguous blocks of ``cores``, one per rank (a remainder stays unused)."""
    if num_ranks < 1:
        raise ValueError("core binding needs at least one local rank")
    per_rank = len(cores) // num_ranks
    if per_rank == 0:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) for {num_ranks} local ranks; give at "
            "least one core per rank (--bind_core_list) or start fewer ranks"
        )
    return [cores[i * per_rank : (i + 1) * per_rank] for i in range(num_ranks)]
