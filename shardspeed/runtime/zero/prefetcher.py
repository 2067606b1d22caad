"""ZeRO-3's look-ahead: gathering the units predicted next, and keeping reused ones gathered.

Per kind of pass (forward, backward) an :class:`~.execution_trace.ExecutionTrace` records the
order units were fetched in. While a pass follows its record, :meth:`Prefetcher.advance` starts
the all-gathers of the units predicted next, up to ``stage3_prefetch_bucket_size`` elements
ahead and within ``stage3_max_live_parameters``; a pass that leaves the record drops what was
started for it. After a unit's forward, :meth:`Prefetcher.keep` says whether the record uses it
again within ``stage3_max_reuse_distance`` elements (then it stays gathered until then, or until
the end of the forward, and gives way first when the live budget is short).

With gradient accumulation the parameters do not change between the micro-steps of one
optimizer step, so :meth:`Prefetcher.hold` keeps every unit gathered from the end of a
micro-step that does not reduce until the backward that does, when all of them fit within both
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` (otherwise every micro-step
gathers again, as DeepSpeed does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardspeed.runtime.zero.execution_trace import ExecutionTrace
from shardspeed.runtime.zero.gather_units import GatherUnit
from shardspeed.runtime.zero.module_agreement import BACKWARD, FORWARD


class Prefetcher:
    """Look-ahead over ``units``; ``live()`` gives the gathered non-persistent elements."""

    def __init__(self, units: Sequence[GatherUnit], options: Any, live: Callable[[], int]) -> None:
        self.units = units
        self.options = options
        self._live = live
        self.traces = {FORWARD: ExecutionTrace(), BACKWARD: ExecutionTrace()}
        #: started ahead of their module and not fetched yet
        self._ahead: list[GatherUnit] = []
        #: left gathered after their forward because they are used again soon
        self._kept: list[GatherUnit] = []
        #: kept gathered until the accumulation window's reducing backward (:meth:`hold`)
        #: (a set: every release asks whether its unit is held)
        self.held: set[GatherUnit] = set()

    def begin(self, phase: int) -> None:
        self.traces[phase].begin()

    def end(self, phase: int) -> None:
        """The pass is over: its order becomes the record; nothing stays ahead or kept."""
        self.traces[phase].end()
        self.drop()
        self._kept = []

    @property
    def recorded(self) -> bool:
        """Whether a pass has been recorded since the start or the last :meth:`forget`."""
        return any(trace.order for trace in self.traces.values())

    def forget(self) -> None:
        """Forget the recorded orders (the module hooks were put back, the model may run
        differently now): the next passes record afresh. What was started ahead is released;
        the values every pass computes are the same either way, only the look-ahead changes."""
        for trace in self.traces.values():
            trace.forget()
        self.drop()

    def fetched(self, unit: GatherUnit) -> None:
        """``unit`` (and what it uses) was fetched for its module."""
        self._kept = [u for u in self._kept if u is not unit]
        self._ahead = [u for u in self._ahead if u is not unit and u not in unit.uses]

    def advance(self, phase: int, unit: GatherUnit, start: bool = True) -> int:
        """Record ``unit`` and start the predicted next units (not when ``start`` is false:
        no unit can be released, so every one is gathered already); returns the live
        elements."""
        trace = self.traces[phase]
        if not trace.visit(unit.index):
            self.drop()
            return self._live()
        if not start:
            return self._live()
        ahead = sum(u.numel for u in self._ahead)
        live = self._live()
        for index in trace.upcoming():
            upcoming = self.units[index]
            if upcoming.gathered:
                continue
            if (
                ahead + upcoming.numel > self.options.prefetch_bucket_size
                or live + upcoming.numel > self.options.max_live_parameters
            ):
                break
            upcoming.start_gather(lossy=True)
            self._ahead.append(upcoming)
            ahead += upcoming.numel
            live += upcoming.numel
        return live

    def drop(self) -> None:
        """Release what was gathered for a prediction that did not come true."""
        for unit in self._ahead:
            unit.release(in_place=True)
        self._ahead = []

    def keep(self, unit: GatherUnit) -> bool:
        """Whether ``unit`` stays gathered after its forward (reused soon); records it if so."""
        distance = 0
        limit = self.options.max_reuse_distance  # 0: never kept
        for index in self.traces[FORWARD].upcoming():
            if index == unit.index:
                if distance < limit:
                    self._kept.append(unit)
                    return True
                return False
            distance += self.units[index].numel
            if distance >= limit:
                return False
        return False

    def hold(self) -> None:
        """A micro-step that does not reduce: keep every unit gathered until the one that
        does, if they all fit in the live budget and the reuse distance."""
        if self.held:
            return
        total = sum(u.numel for u in self.units if not u.persistent)
        if 0 < total <= min(self.options.max_live_parameters, self.options.max_reuse_distance):
            self.held = {u for u in self.units if not u.persistent}

    def unhold(self) -> None:
        """The micro-step reduces: the held units are released as usual from now on."""
        self.held = set()

    def releasable(self, unit: GatherUnit) -> bool:
        return unit not in self.held

    def give_way(self, needed_by: GatherUnit) -> bool:
        """Release the units kept or held for reuse (except those ``needed_by`` fetches);
        whether any were released."""
        released = False
        for unit in [*self._kept, *self.held]:
            if unit is not needed_by and unit not in needed_by.uses and unit.gathered:
                unit.release(in_place=True)
                released = True
        self._kept = []
        self.held = set()
        return released
