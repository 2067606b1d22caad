"""The one checkpoint reader: every engine's ``load_checkpoint`` runs :func:`read_checkpoint`.

The sequence is the same for every format (:class:`~shardspeed.runtime.checkpoint_format
.PlannedFormat`); the format supplies its parts of each step::

    wait for a save in flight; resolve the tag (latest / latest_universal)
    the model-states file; the manifest check; read it            every rank, then agree
    the load plan: the record checked against this model          (planner.plan_load)
    read the module weights (files read safely)                   every rank, then agree
    apply them (ZeRO-3 gathers; pipelines synchronise tied weights)
    the optimizer state, re-partitioned for this run              every rank, then agree
    the state kept apart (experts)                                every rank, then agree
    masters follow the weights where no fp32 state was loaded
    LR scheduler, counters; the rest of the model states is the client state

A rank that fails a step alone tells the others before any collective
(:func:`~shardspeed.runtime.rank_agreement.agree_on`), so no rank is left waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardspeed.checkpoint.files import existing_tag, resolve_tag
from shardspeed.checkpoint.manifest import check_tag
from shardspeed.checkpoint.planner import PLAN_KEY, LoadPlan, plan_load, read_record
from shardspeed.checkpoint.tp_layout import tp_record_of
from shardspeed.runtime import checkpointer
from shardspeed.runtime.onebit_setup import restore_onebit_params
from shardspeed.runtime.rank_agreement import agree_on
from shardspeed.utils.logging import log_dist

if TYPE_CHECKING:
    from shardspeed.runtime.checkpoint_format import E, PlannedFormat


@dataclass(frozen=True)
class LoadOptions:
    """``load_checkpoint``'s arguments."""

    module_strict: bool = True
    optimizer_states: bool = True
    lr_scheduler_states: bool = True
    custom_load_fn: Any = None
    #: None: the config's ``checkpoint.allow_unsafe_pickle``
    allow_unsafe_pickle: bool | None = None


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What a load read: the model-states file, the client state, and the checked plan."""

    path: str
    client_state: dict[str, Any]
    plan: LoadPlan


def read_checkpoint(
    engine: E,
    fmt: PlannedFormat[E],
    load_dir: str,
    tag: str | None,
    options: LoadOptions,
) -> LoadedCheckpoint | None:
    """Load tag ``tag`` of ``load_dir`` (None: the one ``latest`` names) into ``engine``
    through ``fmt``'s steps; None when there is no tag to load."""
    fmt.check_options(options)
    checkpointer.wait(engine)  # a background save of this very tag must be committed first
    config = engine.config.checkpoint
    unsafe = (
        config.allow_unsafe_pickle
        if options.allow_unsafe_pickle is None
        else options.allow_unsafe_pickle
    )
    tag = resolve_tag(load_dir, tag, config.load_universal)
    if tag is None:
        log_dist(f"no 'latest' file in {load_dir} and no tag given: nothing loaded", ranks=[0])
        return None
    folder = existing_tag(load_dir, tag)
    path = folder
    trained = options.optimizer_states and engine.optimizer is not None
    failure, state, plan = None, {}, None
    try:
        path = fmt.states_path(folder)
        check_tag(folder, config.verify_checksums)
        state = fmt.read_states(folder, path, unsafe)
        expected = fmt.expected(engine, options.custom_load_fn is None, trained)
        holdings = read_record(state, str(path))
        tp = tp_record_of(state, str(path))
        plan = plan_load(str(folder), path.name, holdings, expected, tp)
    except Exception as error:  # every rank must learn of it before any collective
        failure = error
    agree_on(failure, f"load checkpoint {folder}", engine.device)
    assert plan is not None
    _load_module(engine, fmt, folder, state, unsafe, options)
    saved, failure = None, None
    if trained:
        try:
            saved = fmt.optimizer_state(engine, folder, state, unsafe)
        except Exception as error:  # every rank must learn of it before any collective
            failure = error
        agree_on(failure, f"load the optimizer state of {folder}", engine.device)
    if saved is not None:
        assert engine.optimizer is not None
        engine.optimizer.load_state_dict(saved)
        try:
            fmt.after_optimizer(engine, folder, state, unsafe)
        except Exception as error:  # every rank must learn of it before any collective
            failure = error
        agree_on(failure, f"load the expert optimizer state of {folder}", engine.device)
    if engine.optimizer is not None and (
        saved is None or not engine.config.zero_optimization.load_from_fp32_weights
    ):
        # no optimizer state loaded, or zero_optimization.load_from_fp32_weights=false: the
        # master weights follow the (possibly 16-bit) module weights just loaded
        engine.strategy.load_state_dict({})
    if saved is not None:
        # 0/1 Adam saved between synchronisations: each rank's own weights win over rank 0's
        restore_onebit_params(engine)
    if (
        options.lr_scheduler_states
        and engine.lr_scheduler is not None
        and state.get("lr_scheduler")
    ):
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.state.load_state_dict(state)
    engine.load_data_efficiency_state(state)
    reserved = fmt.reserved | {PLAN_KEY}
    client_state = {k: v for k, v in state.items() if k not in reserved}
    return LoadedCheckpoint(str(path), client_state, plan)


def _load_module(
    engine: E,
    fmt: PlannedFormat[E],
    folder: Path,
    state: dict[str, Any],
    unsafe: bool,
    options: LoadOptions,
) -> None:
    failure, weights = None, None
    try:
        weights = fmt.read_module(engine, folder, state, unsafe, options)
    except Exception as error:  # every rank must learn of it before any collective
        failure = error
    agree_on(failure, f"load the module weights of {folder}", engine.device)
    fmt.apply_module(engine, weights, options)
