"""The order ZeRO-3 gathered units in during the last forward (or backward), replayed to start
the next units' all-gathers before their modules run (``stage3_prefetch_bucket_size``).

Each pass records the units it fetches. While a pass follows the recorded order, the units
after the current one are the prediction; at the first unit off the order the pass stops
predicting (whatever was started for the wrong prediction is released) and the order it ran
becomes the new record at its end. Every rank records the same order (the ranks check that they
run the same module before each fetch), so every rank starts the same all-gathers in the same
order, and a changed order can never leave one rank waiting for another.
"""

from __future__ import annotations


class ExecutionTrace:
    """The recorded order of unit indices for one kind of pass."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self._current: list[int] = []
        self._cursor = 0
        self._following = False
        #: passes whose order differed from the record before them
        self.changes = 0

    def begin(self) -> None:
        self._current = []
        self._cursor = 0
        self._following = bool(self.order)

    def visit(self, index: int) -> bool:
        """Record a fetch of unit ``index``; whether the pass still follows the record."""
        self._current.append(index)
        if self._following and self._cursor < len(self.order) and self.order[self._cursor] == index:
            self._cursor += 1
            return True
        self._following = False
        return False

    def upcoming(self) -> list[int]:
        """The units predicted to come next (none once the pass left the record)."""
        return self.order[self._cursor :] if self._following else []

    def forget(self) -> None:
        """Drop the record (and the pass in progress): the next pass records afresh and
        nothing is predicted until it ends."""
        self.order = []
        self._current = []
        self._cursor = 0
        self._following = False

    def end(self) -> None:
        """The pass is over: its order is the record from now on."""
        if self._current and self._current != self.order:
            if self.order:
                self.changes += 1
            self.order = self._current
        self._current = []
        self._following = False
