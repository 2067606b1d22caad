"""Where an engine stands in its gradient-accumulation window, and whether a backward reduces.

One object owns what decides it: the micro-step counter's window (in
:class:`~shardspeed.runtime.train_state.TrainState`), a boundary the caller overrode
(``set_gradient_accumulation_boundary``), and the two blocks that hold the reduction back:
``no_sync()`` (no reduction, even at the boundary) and ``coalesce_grad_reduction()`` (one
reduction when the block exits). The engine's verbs of the same names delegate here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shardspeed.runtime.engine_checks import check_no_sync_entry, check_step_allowed
from shardspeed.runtime.train_state import TrainState

__all__ = ["AccumulationWindow"]


class AccumulationWindow:
    """The accumulation bookkeeping of one engine (see the module docstring)."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        #: inside ``engine.no_sync()``
        self.no_sync = False
        #: inside ``engine.coalesce_grad_reduction()``
        self.coalescing = False
        #: the boundary the caller set (None: the micro-step counter decides)
        self.boundary_override: bool | None = None

    def is_boundary(self, gradient_accumulation_steps: int) -> bool:
        """Whether the current micro-step ends the window."""
        if self.boundary_override is not None:
            return self.boundary_override
        return self.state.is_boundary(gradient_accumulation_steps)

    def reduces(self, gradient_accumulation_steps: int) -> bool:
        """Whether the current micro-step's backward reduces its gradients."""
        held_back = self.no_sync or self.coalescing
        return self.is_boundary(gradient_accumulation_steps) and not held_back

    def check_step(self) -> None:
        """Refuse ``engine.step()`` inside a block that holds the reduction back."""
        check_step_allowed(self.no_sync, self.coalescing)

    @contextmanager
    def suppressed(self, supported: bool, stage: int) -> Iterator[None]:
        """The ``no_sync()`` block (``supported``: the strategy allows it, at ZeRO ``stage``)."""
        check_no_sync_entry(supported, self.no_sync, stage)
        self.no_sync = True
        try:
            yield
        finally:
            self.no_sync = False

    @contextmanager
    def coalesced(self) -> Iterator[None]:
        """The ``coalesce_grad_reduction()`` block, without the reduction at its exit."""
        if self.no_sync:
            raise RuntimeError("coalesce_grad_reduction() cannot be used inside no_sync()")
        if self.coalescing:
            raise RuntimeError("coalesce_grad_reduction() blocks cannot be nested")
        self.coalescing = True
        try:
            yield
        finally:
            self.coalescing = False
