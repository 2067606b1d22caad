"""A failure on one pipeline stage stops every stage, with its message, and nothing hangs.

A stage that raises while its neighbours wait in a transfer or a collective would leave them
waiting forever. So a stage records what went wrong (:meth:`StageFailure.record`) and keeps to
the schedule (its sends go out as zeros, or as an "absent" marker, see ``p2p.py``); at the
agreement points (after reading the batch, before the optimizer step, after an evaluation)
every rank learns, in one small all-reduce, whether any rank failed. If one did, every rank
raises: the failing rank its own exception (or a :class:`~.module.PipelineError` for the
engine's own checks), the others a ``PipelineError`` that names the failing stage, rank and
message.
"""

from __future__ import annotations

import torch

from shardspeed import comm
from shardspeed.runtime.pipe.module import PipelineError


class StageFailure:
    """What went wrong on this stage in the current batch (the first failure only)."""

    def __init__(self, stage_id: int, device: torch.device) -> None:
        self.stage_id = stage_id
        self.device = device
        self.message: str | None = None
        self.exception: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.message is not None

    def record(self, message: str, exception: BaseException | None = None) -> None:
        """Remember a failure (a later one in the same batch is a consequence: kept out)."""
        if self.message is None:
            self.message, self.exception = message, exception

    def record_exception(self, exception: BaseException, where: str) -> None:
        self.record(f"{type(exception).__name__} in {where}: {exception}", exception)

    def clear(self) -> None:
        self.message, self.exception = None, None

    def agree(self, where: str, note: int = 0) -> int:
        """Every rank learns whether any rank failed (one all-reduce of two numbers); if one
        did, every rank raises. Also agrees on the largest ``note`` any rank passed and
        returns it."""
        flag = torch.tensor([1.0 if self.failed else 0.0, float(note)], device=self.device)
        world = comm.get_world_size()
        if world > 1:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        if flag[0].item() == 0:
            return int(flag[1].item())
        reports: list[tuple[int, str | None]] = [(self.stage_id, self.message)]
        if world > 1:
            reports = [(0, None)] * world
            comm.all_gather_object(reports, (self.stage_id, self.message))
        own = self.exception
        self.clear()
        if own is not None:
            raise own
        found = "; ".join(
            f"stage {stage} (rank {rank}): {message}"
            for rank, (stage, message) in enumerate(reports)
            if message
        )
        raise PipelineError(
            f"{where} stopped on every rank (this is stage {self.stage_id}): {found}"
        )
