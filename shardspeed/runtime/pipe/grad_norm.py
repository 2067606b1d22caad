"""The global gradient norm of a pipeline: every stage's squares added over the pipeline (the
model-parallel group), each tied weight counted once (on the first stage that holds it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.grad_norm import GradNormReducer, GradSquares
from shardspeed.runtime.zero.strategy import ZeroStrategy


def duplicate_squares(strategy: ZeroStrategy, duplicates: Sequence[torch.Tensor]) -> GradSquares:
    """Minus the squares of the tied weights this stage holds a copy of but does not count,
    from this rank's piece of their unscaled gradients (as the strategy's own parts are split)."""
    device = strategy.placement.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    split_over: CommGroup | None = None
    for weight in duplicates:
        fragment = strategy.param_fragment(weight)  # type: ignore[arg-type]
        if fragment is None:
            continue
        grad = fragment.state_key.grad
        if grad is not None:
            piece = grad.reshape(-1)[fragment.state_slice]
            total = total + piece.double().square().sum()
        if fragment.partitioned:
            split_over = strategy.ctx.data_parallel
    return GradSquares(-total, split_over)


class PipeGradNormReducer(GradNormReducer):
    """:class:`GradNormReducer` over a pipeline: adds ``extra()`` parts (the tied-weight
    correction) and the total over ``model_parallel`` (the stages)."""

    def __init__(
        self, model_parallel: CommGroup | None, extra: Callable[[], list[GradSquares]]
    ) -> None:
        super().__init__(model_parallel)
        self.extra = extra

    def global_norm(self, parts: Sequence[GradSquares], device: torch.device) -> torch.Tensor:
        return super().global_norm([*parts, *self.extra()], device)
