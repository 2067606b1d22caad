"""Agreeing across ranks that a step of a collective verb failed somewhere, so every rank stops.

A rank that fails alone in ``save_checkpoint`` or ``load_checkpoint`` and raises would leave the
others waiting forever in their next collective. Each rank reports whether it failed in one
all-reduce; every rank then raises: the failed ones their own error, the others one that says
another rank failed.
"""

from __future__ import annotations

import torch

from shardspeed import comm


def agree_on(failure: BaseException | None, what: str, device: torch.device) -> None:
    """Raise on every rank if any rank failed to ``what`` (``failure`` is this rank's error,
    None if it succeeded); also a barrier: it returns once every rank got here."""
    if comm.get_world_size() > 1:
        flag = torch.tensor([0.0 if failure is None else 1.0], device=device)
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        if failure is None and flag.item() > 0:
            raise RuntimeError(
                f"another rank failed to {what} (see its error above); this rank stops too"
            )
    if failure is not None:
        raise failure
