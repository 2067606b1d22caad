"""Gather units: the parameters ZeRO-3 gathers together, one unit per module that holds some.

A module's unit is the parameters it registers itself (``parameters(recurse=False)``), as
DeepSpeed fetches them; a leaf module (``set_z3_leaf_modules``, ``zero_optimization.leaf_module``)
holds every parameter of its subtree and nothing inside it gets a unit of its own, so the
subtree is gathered as one piece even where ranks run different submodules. A parameter lives in
the first unit that holds it; a module that registers a parameter living elsewhere (tied input
and output embeddings) or was told to use one (``register_external_parameter``) lists that
unit in :attr:`GatherUnit.uses` and gathers it too. While a strategy manages the model, every
module lists the ones registered to it in DeepSpeed's ``module.ds_external_parameters()``.

A unit's parameters sit in one or more :class:`~shardspeed.runtime.zero.flat_shard.FlatShard`
buffers: one per optimizer parameter group of its trained parameters (the shard group's gradient
buckets) and one for the rest. Its state is its records' :class:`ParamState`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from shardspeed.runtime.zero.flat_shard import FlatShard
from shardspeed.runtime.zero.records import ParamRecord, ParamRegistry, ParamState
from shardspeed.utils.leaf_modules import z3_leaf_module as is_leaf_module

#: parameters a module's forward uses that it does not register (register_external_parameter)
_EXTERNAL: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered as used by ``module``'s forward from elsewhere."""
    return _EXTERNAL.setdefault(module, [])


def ds_external_parameters(module: nn.Module) -> list[tuple[int, nn.Parameter]]:
    """DeepSpeed's ``module.ds_external_parameters()``: ``(id(param), param)`` for each
    parameter registered as used by ``module``'s forward from elsewhere (DeepSpeed keys them by
    ``id``; TRL's ``get_all_parameters`` chains them after ``named_parameters()``)."""
    return [(id(param), param) for param in external_parameters(module)]


class _BoundExternalParameters:
    """``module.ds_external_parameters``: a plain object, not a bound method, so a model that
    carries it still pickles (``torch.save(model)``) and deep-copies (onto the copy)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> list[tuple[int, nn.Parameter]]:
        return ds_external_parameters(self.module)


def expose_external_parameters(root: nn.Module) -> None:
    """Give every module of ``root`` DeepSpeed's ``ds_external_parameters()`` method, as
    DeepSpeed's ZeRO-3 does to the modules it manages."""
    for module in root.modules():
        if "ds_external_parameters" not in module.__dict__:
            module.__dict__["ds_external_parameters"] = _BoundExternalParameters(module)


def hide_external_parameters(root: nn.Module) -> None:
    """Take :func:`expose_external_parameters`' methods off again (the strategy is gone)."""
    for module in root.modules():
        if isinstance(module.__dict__.get("ds_external_parameters"), _BoundExternalParameters):
            del module.__dict__["ds_external_parameters"]


class LiveCount:
    """How many elements of non-persistent units are gathered now, kept up to date by the
    units themselves as they change state (the hooks ask at every module call: a sum over all
    units there made each step quadratic in the number of modules)."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0


class GatherUnit:
    """The parameters one module's forward needs gathered.

    Its buffers change state only through its own methods (:meth:`start_gather`,
    :meth:`finish_gather`, :meth:`release`) or by being replaced (:attr:`flats`); so whether it
    is gathered, and its share of the :class:`LiveCount` it reports to, are kept as plain
    attributes instead of being recomputed from the buffers at every question.
    """

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        records: list[ParamRecord],
        uses: list[GatherUnit] | None = None,
        flats: list[FlatShard] | None = None,
        persistent: bool = False,
    ) -> None:
        self.index = index
        #: the module's qualified name ("" for the root), for error messages
        self.name = name
        self.module = module
        #: parameters that live in this unit (fixed: its elements are counted once)
        self.records = records
        self.numel: int = sum(r.numel for r in records)
        #: units of parameters the module uses that live elsewhere
        self.uses: list[GatherUnit] = uses if uses is not None else []
        #: kept gathered at all times (small parameters, one rank)
        self.persistent = persistent
        #: how many of its parameters an optimizer trains (set when the optimizer is bound)
        self.trained_count = 0
        #: gradients of this unit's trained parameters arrived in the current backward
        self.arrived = 0
        #: all-gathers started and not yet waited for
        self.pending: list[Any] = []
        #: a gather was started and not finished yet (:meth:`finish_gather` has work to do)
        self.gathering = False
        #: ``GatheredParameters`` blocks holding it gathered: nothing releases it meanwhile (a
        #: forward inside the block must not free what the block's code reads after it)
        self.holds = 0
        #: the count of gathered elements this unit adds to while gathered (None: not counted)
        self.live: LiveCount | None = None
        self._counted = 0
        self._flats: list[FlatShard] = []
        self.gathered = True
        self.flats = flats if flats is not None else []

    def __repr__(self) -> str:
        return f"GatherUnit({self.index}, {self.name!r}, gathered={self.gathered})"

    @property
    def flats(self) -> list[FlatShard]:
        """The unit's buffers (see the module docstring)."""
        return self._flats

    @flats.setter
    def flats(self, flats: list[FlatShard]) -> None:
        self._flats = flats
        self._sync()

    def count_in(self, live: LiveCount) -> None:
        """Report this unit's gathered elements to ``live`` from now on."""
        self.live = live
        self._counted = 0
        self._sync()

    def set_persistent(self, persistent: bool) -> None:
        """Keep (or stop keeping) the unit gathered at all times; it leaves the live count."""
        self.persistent = persistent
        self._sync()

    def _sync(self) -> None:
        """Re-read whether the buffers are gathered and settle this unit's live count."""
        self.gathered = all(flat.gathered for flat in self._flats)
        if self.live is not None:
            counted = self.numel if self.gathered and not self.persistent else 0
            self.live.total += counted - self._counted
            self._counted = counted

    @property
    def lossy(self) -> bool:
        """Whether a buffer holds dequantized values of a quantized gather (ZeRO++ qwZ)."""
        return any(flat.lossy for flat in self._flats)

    def start_gather(self, lossy: bool = False) -> None:
        """Start all-gathering every released buffer (:meth:`finish_gather` waits).

        ``lossy``: the hooks' gathers, which ZeRO++ may quantize (qwZ) or serve from the
        secondary shards (hpZ); otherwise the values must be exact (they are kept or
        written back), and a unit gathered lossy is gathered again."""
        if self.gathered:
            if lossy or not self.lossy:
                return
            if self.gathering:  # the lossy gather in flight must not land after the exact one
                self.finish_gather()
        self._set_state(ParamState.GATHERING)
        self.pending = [work for flat in self._flats if (work := flat.gather(lossy)) is not None]
        self.gathering = True
        self._sync()

    def finish_gather(self) -> None:
        """Wait for the all-gathers in flight; the parameters are whole after it."""
        for work in self.pending:
            work.wait()
        self.pending = []
        self.gathering = False
        for flat in self._flats:  # parameter offload: the shards leave memory again
            flat.shard_out()
        self._set_state(ParamState.GATHERED)
        self._sync()

    def gather(self, lossy: bool = False) -> None:
        self.start_gather(lossy)
        self.finish_gather()

    def release(self, force: bool = False, in_place: bool = False) -> None:
        """Free the full buffers (a persistent unit only when ``force``); ``in_place``: shrink
        their storage, for the hooks between a forward and its backward (see
        :meth:`.FlatShard.release`)."""
        if (self.persistent and not force) or self.holds:
            return
        if self.gathering:  # never free memory an all-gather is writing into
            self.finish_gather()
        for flat in self._flats:
            flat.release(in_place)
        self._sync()
        self._set_state(ParamState.GATHERED if self.gathered else ParamState.SHARDED)

    def _set_state(self, state: ParamState) -> None:
        for record in self.records:
            record.state = state


#: where zero.Init keeps the unit of a module it partitioned at construction (the module
#: keeps it alive until the engine's strategy takes its parameters over)
CONSTRUCTED_UNIT_ATTR = "_shardspeed_constructed_unit"


class _ConstructedUnit:
    """The holder of a construction-time unit in its module's ``__dict__``. A deep copy of the
    module holds its parameters whole (see :meth:`.ZeroParameter.__deepcopy__`), so it has no
    such unit: the holder's copy is None."""

    __slots__ = ("unit",)

    def __init__(self, unit: GatherUnit) -> None:
        self.unit = unit

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        del memo


def set_constructed_unit(module: nn.Module, unit: GatherUnit) -> None:
    """Keep ``unit``, made by ``zero.Init`` for ``module``'s own parameters, on ``module``."""
    module.__dict__[CONSTRUCTED_UNIT_ATTR] = _ConstructedUnit(unit)


def constructed_unit(module: nn.Module) -> GatherUnit | None:
    held = module.__dict__.get(CONSTRUCTED_UNIT_ATTR)
    return held.unit if isinstance(held, _ConstructedUnit) else None


def constructed_units(module: nn.Module) -> dict[int, GatherUnit]:
    """Each parameter partitioned by ``zero.Init`` in ``module``'s tree -> its unit, by id."""
    found: dict[int, GatherUnit] = {}
    for sub in module.modules():
        unit = constructed_unit(sub)
        if unit is not None:
            for record in unit.records:
                found.setdefault(id(record.param), unit)
    return found


def forget_constructed_units(module: nn.Module) -> None:
    """Drop the construction-time units (their parameters moved into the strategy's)."""
    for sub in module.modules():
        held = sub.__dict__.pop(CONSTRUCTED_UNIT_ATTR, None)
        if isinstance(held, _ConstructedUnit):
            held.unit.flats = []


def _module_params(module: nn.Module) -> Iterator[nn.Parameter]:
    # a leaf module holds its whole subtree
    yield from module.parameters(recurse=is_leaf_module(module))


def plan_units(module: nn.Module, registry: ParamRegistry) -> list[GatherUnit]:
    """One unit per module that holds parameters, in module order (see the module docstring);
    then each module's uses: parameters it registers or was given that live elsewhere."""
    units: list[GatherUnit] = []
    unit_of_module: dict[int, GatherUnit] = {}
    home: dict[int, GatherUnit] = {}
    planned: list[tuple[str, nn.Module]] = []
    inside_leaf: set[int] = set()
    for name, sub in module.named_modules():
        if id(sub) in inside_leaf:
            continue
        if is_leaf_module(sub):
            inside_leaf.update(id(m) for m in sub.modules() if m is not sub)
        planned.append((name, sub))
        own = [r for p in _module_params(sub) if id(r := registry[p]) not in home]
        if own:
            unit = GatherUnit(len(units), name, sub, own)
            for record in own:
                home[id(record)] = unit
                record.unit = unit
            units.append(unit)
            unit_of_module[id(sub)] = unit
    for name, sub in planned:
        uses: list[GatherUnit] = []
        for param in [*_module_params(sub), *external_parameters(sub)]:
            found = registry.get(param)
            elsewhere = None if found is None else home.get(id(found))
            if elsewhere is not None and elsewhere.module is not sub and elsewhere not in uses:
                uses.append(elsewhere)
        if not uses:
            continue
        user = unit_of_module.get(id(sub))
        if user is None:
            user = GatherUnit(len(units), name, sub, [])
            units.append(user)
        user.uses = uses
    return units
