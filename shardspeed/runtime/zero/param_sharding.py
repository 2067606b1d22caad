"""ZeRO-3's parameters: every parameter lives as this rank's shard, gathered around its use.

:class:`ParamSharding` owns the :class:`~.gather_units.GatherUnit`\\ s of a module and the hooks
that move them between ``SHARDED`` and ``GATHERED``:

* **forward**: a unit is gathered by its module's forward pre-hook (with the units it uses) and
  released by the forward hook, which first registers a hook on the module's outputs that
  gathers the unit again when backward reaches the module;
* **backward**: a unit is released as soon as every one of its parameters got its gradient
  (autograd accumulates a parameter's gradient once, after every use of it), the rest when the
  backward ends. A forward that runs inside backward (activation checkpointing recomputing) does
  not release: the backward running it still needs the parameters;
* small units (``stage3_param_persistence_threshold``, up to
  ``stage3_model_persistence_threshold`` elements in all) stay gathered.

The hooks only delegate here; :class:`~.module_hooks.ModuleHooks` installs them (they can be
taken off and put back, DeepSpeed's ``parameter_offload`` hook lists, see
:mod:`~.parameter_offload`); the buffers are :class:`~.flat_shard.FlatShard` objects. Trained
parameters move into their shard group's bucket layout when the optimizer is bound
(:meth:`ParamSharding.adopt_buckets`), so a bucket's reduce-scatter hands every rank the
gradient of exactly its shard.

Every parameter is sharded over the process group it reduces over (``comm_of``): the
data-parallel group, or, for Mixture-of-Experts parameters, their expert-data-parallel group
(the ranks holding the same experts). A unit whose parameters reduce over several groups keeps
one buffer per group, each gathered over its own group; its initial weights come from that
group's first rank (the data-parallel group's for the dense parameters: MiCS broadcasts them
over the whole data-parallel group, wider than its shard group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shardspeed.runtime.zero.buckets import GradBucket
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.flat_shard import FlatShard, pack_flat_shards
from shardspeed.runtime.zero.gather_units import (
    GatherUnit,
    LiveCount,
    constructed_units,
    expose_external_parameters,
    forget_constructed_units,
    hide_external_parameters,
    plan_units,
)
from shardspeed.runtime.zero.module_agreement import (
    BACKWARD,
    FORWARD,
    ModuleAgreement,
    describe_unit,
)
from shardspeed.runtime.zero.module_hooks import ModuleHooks
from shardspeed.runtime.zero.prefetcher import Prefetcher
from shardspeed.runtime.zero.records import ParamRecord, ParamRegistry, record_of
from shardspeed.runtime.zero.residency import residency_for
from shardspeed.runtime.zero.state_swap import SwapStore
from shardspeed.runtime.zero.zero_parameter import mark_partitioned, unmark_partitioned


@dataclass(frozen=True)
class ShardingOptions:
    """DeepSpeed's stage 3 knobs that decide what stays gathered."""

    #: ``stage3_param_persistence_threshold``: parameters below it stay gathered
    param_persistence_threshold: int = 100_000
    #: ``stage3_model_persistence_threshold``: at most this many persistent elements in all
    model_persistence_threshold: int = 2**63 - 1
    #: ``stage3_max_live_parameters``: gathered (non-persistent) elements allowed at once,
    #: beyond the one unit being gathered
    max_live_parameters: int = 1_000_000_000
    #: ``stage3_prefetch_bucket_size``: elements gathered ahead of the module that runs
    prefetch_bucket_size: int = 50_000_000
    #: ``stage3_max_reuse_distance``: a unit used again after fewer than this many elements of
    #: other units' fetches (in the recorded forward order) stays gathered in between (0: never)
    max_reuse_distance: int = 1_000_000_000


def _distinct(units: Iterable[GatherUnit | None]) -> list[GatherUnit]:
    seen: list[GatherUnit] = []
    for unit in units:
        if unit is not None and unit not in seen:
            seen.append(unit)
    return seen


class ParamSharding:
    """The gather units of ``module`` and the hooks that gather and release them."""

    def __init__(
        self,
        module: nn.Module,
        registry: ParamRegistry,
        comm: CommGroup,
        options: ShardingOptions,
        source: CommGroup | None = None,
        comm_of: Callable[[ParamRecord], CommGroup] | None = None,
    ) -> None:
        self.module = module
        #: the group parameters are sharded over unless ``comm_of`` says otherwise
        self.comm = comm
        #: the group the initial weights of ``comm``'s parameters are broadcast over (MiCS: the
        #: world, wider than the shard group ``comm``)
        self.source = source if source is not None else comm
        #: the group each parameter is sharded (and its gradient reduced) over
        self.comm_of: Callable[[ParamRecord], CommGroup] = comm_of or (lambda record: comm)
        #: ids of the flat buffers laid out as a shard group's gradient buckets
        self._bucket_flats: set[int] = set()
        self.options = options
        self.units = plan_units(module, registry)
        #: the gathered elements of the non-persistent units, kept by the units
        self.live = LiveCount()
        for unit in self.units:
            unit.count_in(self.live)
        #: whether any buffer can be released at all (else, one rank without NVMe offload:
        #: every unit is gathered for good, and the hooks skip releasing and prefetching)
        self.moves = False
        #: the trained parameters whose gradients release their unit (hooked while ``moves``)
        self._watched: list[ParamRecord] = []
        self._grad_handles: list[Any] = []
        self._in_backward = False
        #: the root module's hooks around the whole forward, and the gradient hooks
        self._handles: list[Any] = []
        self._end_handle: Any = None
        #: every unit's module hooks (DeepSpeed's ``forward_hooks`` / ``backward_hooks``)
        self.hooks = ModuleHooks(self)
        #: the most non-persistent parameter elements gathered at once by the hooks
        self.peak_live = 0
        self.agreement = ModuleAgreement(comm, self.units)
        self.registry = registry
        self._param_count = sum(1 for _ in module.parameters())
        #: parameter offload: the host memory or the NVMe store shards live in between uses
        self._offload_host: torch.device | None = None
        self._offload_store: SwapStore | None = None
        self.prefetcher = Prefetcher(self.units, options, self.live_numel)

    def offload_to(self, host: torch.device | None, store: SwapStore | None) -> None:
        """``offload_param``: from now on the non-persistent units' shards live in ``host``
        memory or in ``store``'s files between uses."""
        self._offload_host, self._offload_store = host, store
        self._offload_units()

    def _offload_units(self) -> None:
        for unit in self.units:
            if not unit.persistent:
                self._offload_unit(unit)
        self._update_moves()

    def _update_moves(self) -> None:
        """Find out whether any buffer can be released (the buffers changed), and hook the
        watched gradients if one can."""
        self.moves = any(
            flat.comm.partitioned or flat.residency.swapped
            for unit in self.units
            for flat in unit.flats
        )
        if self.moves and not self._grad_handles:
            self._grad_handles = [
                record.param.register_post_accumulate_grad_hook(partial(self._on_grad, record))
                for record in self._watched
            ]

    def _offload_unit_agreed(self, unit: GatherUnit) -> None:
        """Offload ``unit``; with NVMe, every rank learns whether every rank could (a full
        disk on one rank must not leave the others waiting in the next unit's broadcast)."""
        if self._offload_store is None:
            self._offload_unit(unit)
            return
        failure = None
        try:
            self._offload_unit(unit)
        except Exception as error:  # noqa: BLE001 - re-raised below, after the agreement
            failure = error
        self.agreement.all_succeeded(failure, f"swap {describe_unit(self.units, unit.index)} out")

    def _offload_unit(self, unit: GatherUnit) -> None:
        if self._offload_host is None and self._offload_store is None:
            return
        for number, flat in enumerate(unit.flats):
            key = f"unit{unit.index}_{number}"
            flat.offload(residency_for(self._offload_host, self._offload_store, key))

    # -- setting up -------------------------------------------------------------------------
    def _pack(self, records: Sequence[ParamRecord]) -> list[FlatShard]:
        """``records``' parameters in flat buffers, one per process group they are sharded
        over (and dtype)."""
        by_comm: dict[CommGroup, list[nn.Parameter]] = {}
        for record in records:
            by_comm.setdefault(self.comm_of(record), []).append(record.param)
        return [
            flat for group, params in by_comm.items() for flat in pack_flat_shards(params, group)
        ]

    def _source_of(self, group: CommGroup) -> CommGroup:
        """The group whose first rank's weights a buffer sharded over ``group`` starts from:
        another group than ``comm`` (expert parameters) is its own source, its ranks being
        the only ones holding those parameters."""
        return self.source if group == self.comm else group

    def _broadcast(self, flats: Sequence[FlatShard]) -> None:
        """Give ``flats`` (gathered) their source group's first rank's values."""
        for flat in flats:
            source = self._source_of(flat.comm)
            if source.partitioned:
                source.broadcast(flat.full)
                flat.keep_full_values()

    @torch.no_grad()
    def shard(
        self, dtype: torch.dtype | None, device: torch.device | None, broadcast: bool
    ) -> None:
        """Keep only this rank's shard of every parameter, unit by unit, and install the hooks.

        Each unit's parameters are cast to ``dtype`` (floating ones; None keeps theirs), moved
        to ``device`` (None keeps it) and, if ``broadcast``, given the values of the first rank
        of their source group (see :meth:`_source_of`). Parameters partitioned at construction
        (``zero.Init``, over the data-parallel group) are gathered one unit at a time, so the
        whole model is never held at once, and sharded again over their own group."""
        constructed = constructed_units(self.module)
        # how many of each construction-time unit's parameters are still to move: its shards
        # are freed as soon as none is left (never two copies of the model's shards at once)
        left: dict[int, int] = {}
        for built in constructed.values():
            left[id(built)] = len(built.records)
        budget = self.options.model_persistence_threshold
        for unit in self.units:
            earlier = _distinct(constructed.get(id(r.param)) for r in unit.records)
            self._fetch(earlier)
            for record in unit.records:
                param = record.param
                cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
                param.data = param.data.to(device=device or param.device, dtype=cast)
            unit.flats = self._pack(unit.records)
            if broadcast:
                self._broadcast(unit.flats)
            small = all(r.numel < self.options.param_persistence_threshold for r in unit.records)
            if small and unit.numel <= budget:
                unit.set_persistent(True)
                budget -= unit.numel
            unit.finish_gather()
            for record in unit.records:
                mark_partitioned(record.param)
            unit.release()
            if not unit.persistent:
                self._offload_unit_agreed(unit)
            for done in earlier:
                done.release()
            for record in unit.records:
                source = constructed.get(id(record.param))
                if source is not None:
                    left[id(source)] -= 1
                    if left[id(source)] == 0:
                        source.flats = []  # every parameter moved: its shards go
        forget_constructed_units(self.module)
        self._update_moves()
        # the whole forward's start: before every unit's hooks (its end: install_hooks)
        self._handles.append(
            self.module.register_forward_pre_hook(self._begin_forward, prepend=True)
        )
        self.install_hooks(self.units)
        expose_external_parameters(self.module)

    def adopt_buckets(
        self, buckets: Sequence[GradBucket], comm_group: CommGroup
    ) -> list[FlatShard]:
        """Lay the trained parameters out as the shard group's ``buckets`` (one flat buffer
        each, in bucket order, sharded over ``comm_group``: Mixture of Experts shards
        expert parameters over their expert-data-parallel group); a unit's other parameters
        keep the bucket buffers of the shard groups adopted before, or a buffer per group of
        their own."""
        by_unit: dict[int, list[GradBucket]] = {}
        for bucket in buckets:
            unit = self._unit_of(bucket.params[0])
            by_unit.setdefault(unit.index, []).append(bucket)
        adopted: dict[int, FlatShard] = {}
        for index, unit_buckets in by_unit.items():
            unit = self.units[index]
            was_gathered = unit.gathered
            self._fetch([unit])
            # a unit reducing over several groups: another group's buckets stay as they are
            flats = [flat for flat in unit.flats if id(flat) in self._bucket_flats]
            placed = {id(p) for flat in flats for p in flat.params}
            for bucket in unit_buckets:
                flat = FlatShard(bucket.params, bucket.offsets, bucket.size, comm_group)
                adopted[bucket.index] = flat
                self._bucket_flats.add(id(flat))
                flats.append(flat)
                placed.update(id(p) for p in bucket.params)
            rest = [r for r in unit.records if id(r.param) not in placed]
            unit.flats = flats + self._pack(rest)
            if not was_gathered:
                unit.release()
        self._offload_units()
        return [adopted[bucket.index] for bucket in buckets]

    @staticmethod
    def _unit_of(param: nn.Parameter) -> GatherUnit:
        record = record_of(param)
        assert record is not None and record.unit is not None, "a parameter in no gather unit"
        return record.unit

    def use(self, module: nn.Module, param: nn.Parameter) -> None:
        """From now on ``module``'s forward also gathers ``param``'s unit."""
        record = record_of(param)
        home = None if record is None else record.unit
        if home is None or home not in self.units or home.module is module:
            return
        unit = next((u for u in self.units if u.module is module), None)
        if unit is None:
            unit = GatherUnit(len(self.units), type(module).__name__, module, [])
            unit.count_in(self.live)
            self.units.append(unit)
            self.install_hooks([unit])
        if home not in unit.uses:
            unit.uses.append(home)

    def install_hooks(self, units: Sequence[GatherUnit]) -> None:
        """Install ``units``' module hooks, replacing those they have (never doubled): at
        :meth:`shard`, and when the hooks are put back after being taken off (see
        :mod:`~.module_hooks`)."""
        self.hooks.install(units)
        # the whole forward's end: after every unit's hooks, the root module's own included
        if self._end_handle is not None:
            self._end_handle.remove()
        self._end_handle = self.module.register_forward_hook(self._end_forward)

    def units_in(self, module: nn.Module) -> list[GatherUnit]:
        """The units of ``module`` and the modules inside it (ValueError if it is not part
        of this model)."""
        if module is self.module:
            return list(self.units)
        if not any(sub is module for sub in self.module.modules()):
            raise ValueError(
                f"{type(module).__name__} is not a module of this ZeRO-3 model "
                f"({type(self.module).__name__}); pass the model or one of its submodules"
            )
        inside = {id(sub) for sub in module.modules()}
        return [unit for unit in self.units if id(unit.module) in inside]

    def watch_gradients(self, records: Iterable[ParamRecord]) -> None:
        """Release a unit once all its trained parameters got their gradients (hooked only
        where a unit can be released: one more per-parameter hook is a Python call per
        gradient)."""
        for record in records:
            assert record.unit is not None
            record.unit.trained_count += 1
            self._watched.append(record)
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = []
        self._update_moves()

    def remove_hooks(self) -> None:
        """Remove every hook and DeepSpeed view this sharding installed (destroy)."""
        for handle in [*self._handles, *self._grad_handles]:
            handle.remove()
        self._handles.clear()
        self._grad_handles = []
        self._watched = []
        self.hooks.remove_all()
        if self._end_handle is not None:
            self._end_handle.remove()
            self._end_handle = None
        hide_external_parameters(self.module)
        for unit in self.units:
            for record in unit.records:
                unmark_partitioned(record.param)

    # -- gathering --------------------------------------------------------------------------
    def _fetch(self, units: Iterable[GatherUnit], lossy: bool = False) -> None:
        """Gather ``units`` (all their all-gathers in flight at once; ``lossy``: the hooks')."""
        chosen = list(units)
        for unit in chosen:
            unit.start_gather(lossy)
        for unit in chosen:
            if unit.gathering:  # (started here or ahead; a gathered unit has nothing to wait)
                unit.finish_gather()

    def fetch(self, unit: GatherUnit) -> None:
        """Gather ``unit`` and the units it uses, within ``stage3_max_live_parameters``."""
        wanted = [u for u in (unit, *unit.uses) if not u.gathered]
        needed = sum(u.numel for u in wanted if not u.persistent)
        live = self.live_numel()
        if live + needed > self.options.max_live_parameters and self.prefetcher.give_way(unit):
            live = self.live_numel()
        if live and live + needed > self.options.max_live_parameters:
            held = sorted(
                (u for u in self.units if u.gathered and not u.persistent),
                key=lambda u: -u.numel,
            )[:4]
            raise RuntimeError(
                f"ZeRO stage 3: gathering {self._describe(unit.index)} ({needed} elements) "
                f"would hold {live + needed} parameter elements at once, over "
                f"zero_optimization.stage3_max_live_parameters={self.options.max_live_parameters} "
                f"({live} already gathered, largest: "
                + ", ".join(f"{self._describe(u.index)} {u.numel}" for u in held)
                + "). Raise stage3_max_live_parameters, or make the nesting shallower (a "
                "module's own parameters stay gathered while its children run)"
            )
        self._fetch([unit, *unit.uses], lossy=True)  # also waits for those started ahead
        self.prefetcher.fetched(unit)
        self.peak_live = max(self.peak_live, live + needed)

    def _advance(self, phase: int, unit: GatherUnit) -> None:
        live = self.prefetcher.advance(phase, unit, start=self.moves)
        self.peak_live = max(self.peak_live, live)

    def live_numel(self) -> int:
        """Elements of the non-persistent units gathered now."""
        return self.live.total

    def release(self, unit: GatherUnit) -> None:
        """Release ``unit`` and the units it uses, except those held for the next micro-step."""
        for done in (unit, *unit.uses):
            self._release_one(done)

    def _release_one(self, unit: GatherUnit) -> None:
        # in place: autograd's saved views of the parameters see the re-gather for backward
        if self.prefetcher.releasable(unit):
            unit.release(in_place=True)

    def release_all(self) -> None:
        if not self.moves:
            return
        for unit in self.units:
            self._release_one(unit)

    def empty_cache(self) -> None:
        """Release every unit, persistent and held ones too (they are gathered again when
        used)."""
        self.prefetcher.unhold()
        for unit in self.units:
            unit.release(force=True)

    @contextmanager
    def gathered(self, units: Sequence[GatherUnit] | None = None) -> Iterator[None]:
        """``units`` (default: every unit) gathered inside the block; those that were released
        before are released again after it."""
        chosen = self.units if units is None else units
        released = [unit for unit in chosen if not unit.gathered]
        self._fetch(chosen)
        try:
            yield
        finally:
            for unit in released:
                unit.release()

    def keep_full_values(self) -> None:
        """The (gathered) units' full values were written: make the shards follow them."""
        for unit in self.units:
            for flat in unit.flats:
                flat.keep_full_values()

    # -- hooks (installed by ModuleHooks) ----------------------------------------------------
    def pre_forward(self, unit: GatherUnit, module: nn.Module, args: Any) -> None:
        """Gather ``unit`` (and what it uses) before its module's forward."""
        del module, args
        self.agreement.check(unit, FORWARD)
        self.fetch(unit)
        if not self._in_backward:  # a recompute inside backward is not the forward's order
            self._advance(FORWARD, unit)
        for used in (unit, *unit.uses):
            for record in used.records:
                record.active.add(unit.index)

    def arm_post_backward(self, unit: GatherUnit, module: nn.Module, args: Any) -> None:
        """A unit whose own parameters get no gradient is released after its backward when
        its inputs' gradients are done."""
        del module
        if unit.records and not unit.trained_count and torch.is_grad_enabled():
            inputs = [
                t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, partial(self._after_backward, unit), mode="all"
                )

    def arm_pre_backward(self, unit: GatherUnit, module: nn.Module, args: Any, output: Any) -> None:
        """Gather ``unit`` again when backward reaches its module's outputs."""
        del module, args
        if torch.is_grad_enabled():
            needing = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if needing:
                torch.autograd.graph.register_multi_grad_hook(
                    needing, partial(self._pre_backward, unit), mode="any"
                )

    def post_forward(self, unit: GatherUnit, module: nn.Module, args: Any, output: Any) -> None:
        """Release ``unit`` after its module's forward, unless it is reused soon."""
        del module, args, output
        for used in (unit, *unit.uses):
            for record in used.records:
                record.active.discard(unit.index)
        if self._in_backward or not self.moves:  # (nothing to release, nothing to keep)
            return
        if self.prefetcher.keep(unit):
            for used in unit.uses:
                self._release_one(used)
        else:
            self.release(unit)

    def _pre_backward(self, unit: GatherUnit, grad: Any) -> None:
        del grad
        self.agreement.check(unit, BACKWARD)
        self.fetch(unit)
        self._advance(BACKWARD, unit)

    def _after_backward(self, unit: GatherUnit, grads: Any) -> None:
        del grads
        if self._in_backward:
            self._release_one(unit)

    def check_gathered(self, unit: GatherUnit) -> None:
        """With ``unit``'s module hooks taken off, its forward needs its parameters gathered
        by the caller: refuse to compute on released (empty) ones."""
        released = [u for u in (unit, *unit.uses) if not u.gathered]
        if not released:
            return
        raise RuntimeError(
            f"ZeRO stage 3: {self._describe(unit.index)} ran its forward with the parameters of "
            + ", ".join(self._describe(u.index) for u in released)
            + " released while the ZeRO-3 module hooks are removed (optimizer.parameter_offload."
            "forward_hooks, as TRL's remove_hooks does), so nothing gathers them. Gather them "
            "around the forward (deepspeed.zero.GatheredParameters(model.parameters())), or put "
            "the hooks back first: engine.optimizer.parameter_offload._register_deepspeed_module"
            "(engine.module) (TRL's add_hooks)"
        )

    def _describe(self, index: int) -> str:
        return describe_unit(self.units, index)

    def _on_grad(self, record: ParamRecord, param: torch.Tensor) -> None:
        del param
        unit = record.unit
        assert unit is not None
        unit.arrived += 1
        # frozen parameters of the unit may still be needed later in this backward
        if self._in_backward and unit.arrived == unit.trained_count == len(unit.records):
            self._release_one(unit)

    def _begin_forward(self, module: nn.Module, args: Any) -> None:
        del module, args
        if not self._in_backward:
            self.prefetcher.begin(FORWARD)

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        del module, args, output
        self._refuse_new_parameters()
        if not self._in_backward:
            self.prefetcher.end(FORWARD)
            self.release_all()

    def _refuse_new_parameters(self) -> None:
        """A parameter that appeared after ``initialize`` (created in a forward, or assigned
        to the model later) is neither sharded nor stepped: say so instead of training on
        without it."""
        if sum(1 for _ in self.module.parameters()) == self._param_count:
            return
        new = [n for n, p in self.module.named_parameters() if p not in self.registry]
        if not new:
            self._param_count = sum(1 for _ in self.module.parameters())
            return
        raise RuntimeError(
            f"ZeRO stage 3: the model has parameters it did not have at initialize ({', '.join(new[:5])}"
            + (f" and {len(new) - 5} more" if len(new) > 5 else "")
            + "): they would be neither partitioned nor updated by the optimizer. Create every "
            "parameter in its module's __init__ (under shardspeed.zero.Init for a model too "
            "large to build whole), before shardspeed.initialize; a lazy module (nn.LazyLinear) "
            "must run one forward before initialize"
        )

    def begin_backward(self, reduce: bool) -> None:
        """A backward starts; one that does not ``reduce`` (a micro-step inside an
        accumulation window) leaves the units gathered for the next micro-step, when they fit
        (see :meth:`.Prefetcher.hold`)."""
        if reduce:
            self.prefetcher.unhold()
        else:
            self.prefetcher.hold()
        self._in_backward = True
        for unit in self.units:
            unit.arrived = 0
        self.prefetcher.begin(BACKWARD)

    def end_backward(self) -> None:
        self._in_backward = False
        self.prefetcher.end(BACKWARD)
        self.release_all()
