"""What an engine saves and loads checkpoints through: a :class:`CheckpointFormat`.

Every format is a :class:`PlannedFormat`: it states what each rank's files hold
(:meth:`~PlannedFormat.plan_save`, a :class:`~shardspeed.checkpoint.planner.SavePlan`) and how
its parts of a tag are read back (the load steps), and goes through the one writer
(:func:`shardspeed.runtime.checkpointer.save`) and the one reader
(:func:`shardspeed.runtime.checkpoint_reader.read_checkpoint`). Two formats exist, both in
DeepSpeed's file layout: ZeRO 0-3 with Mixture-of-Experts models
(:data:`shardspeed.runtime.zero_checkpoint.ZERO_FORMAT`) and pipelines
(:data:`shardspeed.runtime.pipe.checkpoint.PIPELINE_FORMAT`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from shardspeed.runtime import checkpoint_reader, checkpointer

if TYPE_CHECKING:
    from shardspeed.checkpoint.planner import SavePlan, Shape
    from shardspeed.runtime.checkpoint_reader import LoadOptions
    from shardspeed.runtime.engine import DeepSpeedEngine

#: the engine class a format serves
E = TypeVar("E", bound="DeepSpeedEngine")


class CheckpointFormat(Protocol):
    """``save_checkpoint`` and ``load_checkpoint`` of an engine."""

    def save(
        self,
        engine: Any,
        save_dir: str,
        tag: str | None,
        client_state: dict[str, Any],
        save_latest: bool,
        exclude_frozen_parameters: bool,
    ) -> bool: ...

    def load(
        self,
        engine: Any,
        load_dir: str,
        tag: str | None,
        *,
        load_module_strict: bool,
        load_optimizer_states: bool,
        load_lr_scheduler_states: bool,
        custom_load_fn: Any,
        allow_unsafe_pickle: bool | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]: ...


class PlannedFormat(ABC, Generic[E]):
    """A format whose saves are plans written by the one writer and whose loads are steps run
    by the one reader (the steps, in the reader's order, are the methods below)."""

    #: model-states keys that are the format's own, not the caller's client state
    reserved: frozenset[str] = frozenset()

    def save(
        self,
        engine: E,
        save_dir: str,
        tag: str | None,
        client_state: dict[str, Any],
        save_latest: bool,
        exclude_frozen_parameters: bool,
    ) -> bool:
        return checkpointer.save(
            engine,
            save_dir,
            tag,
            client_state,
            save_latest,
            exclude_frozen_parameters,
            planner=self.plan_save,
        )

    def load(
        self,
        engine: E,
        load_dir: str,
        tag: str | None,
        *,
        load_module_strict: bool,
        load_optimizer_states: bool,
        load_lr_scheduler_states: bool,
        custom_load_fn: Any,
        allow_unsafe_pickle: bool | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        options = checkpoint_reader.LoadOptions(
            module_strict=load_module_strict,
            optimizer_states=load_optimizer_states,
            lr_scheduler_states=load_lr_scheduler_states,
            custom_load_fn=custom_load_fn,
            allow_unsafe_pickle=allow_unsafe_pickle,
        )
        loaded = checkpoint_reader.read_checkpoint(engine, self, load_dir, tag, options)
        return (None, None) if loaded is None else (loaded.path, loaded.client_state)

    # -- save ---------------------------------------------------------------------------------
    @abstractmethod
    def plan_save(
        self,
        engine: E,
        client_state: dict[str, Any],
        exclude_frozen_parameters: bool,
        commits: bool,
    ) -> SavePlan:
        """This rank's files and what each holds (``commits``: this rank writes the shared
        files)."""

    # -- load, in the reader's order ----------------------------------------------------------
    def check_options(self, options: LoadOptions) -> None:
        """Refuse load options this format does not support (before anything is read)."""
        del options

    @abstractmethod
    def states_path(self, folder: Path) -> Path:
        """The tag's model-states file (the one holding the record and the counters); raises
        FileNotFoundError naming it when ``folder`` has none."""

    @abstractmethod
    def read_states(self, folder: Path, path: Path, unsafe: bool) -> dict[str, Any]:
        """The model-states file ``path``'s content (checked to be this format's)."""

    @abstractmethod
    def expected(
        self, engine: E, module: bool, optimizer: bool
    ) -> Mapping[str, Mapping[str, Shape]]:
        """family -> name -> global shape of what this rank's model reads from a checkpoint
        (``module``: its weights, ``optimizer``: its optimizer state)."""

    @abstractmethod
    def read_module(
        self,
        engine: E,
        folder: Path,
        state: dict[str, Any],
        unsafe: bool,
        options: LoadOptions,
    ) -> Any:
        """Read (and, where that needs no collective, load) this rank's module weights."""

    @abstractmethod
    def apply_module(self, engine: E, weights: Any, options: LoadOptions) -> None:
        """Finish loading the module weights (every rank; may be collective)."""

    @abstractmethod
    def optimizer_state(
        self, engine: E, folder: Path, state: dict[str, Any], unsafe: bool
    ) -> dict[str, Any] | None:
        """This rank's optimizer-wrapper state, re-partitioned for this run; None if the
        checkpoint holds none."""

    def after_optimizer(self, engine: E, folder: Path, state: dict[str, Any], unsafe: bool) -> None:
        """Set what the optimizer-wrapper state left out (the experts' state, kept apart)."""
        del engine, folder, state, unsafe
