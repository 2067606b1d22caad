"""What the engine does for data efficiency, in one object the engine calls.

* the legacy ``curriculum_learning`` section (seqlen): before each training forward the
  schedule moves to ``global_steps + 1`` and the forward gets ``curriculum_seqlen=<difficulty>``
  as a keyword, as in DeepSpeed; the model truncates its sequences to it. DeepSpeed passes the
  keyword to any model, so one whose ``forward`` does not take it fails with Python's
  "unexpected keyword argument"; shardspeed checks the signature once and raises a
  ``TypeError`` that says what to add instead;
* random-LTD (``data_efficiency.data_routing.random_ltd``): the scheduler, the layers it
  configures (:meth:`random_ltd_initialize`), and the kept length moved to ``global_steps``
  before each training forward, as in DeepSpeed;
* the states of both and of the curriculum sampler, saved with the checkpoint under
  DeepSpeed's keys (``random_ltd``, ``data_sampler``) and ``curriculum_scheduler_legacy``.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from shardspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from shardspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from shardspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from shardspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

__all__ = ["DataEfficiencyHooks"]

SEQLEN_KWARG = "curriculum_seqlen"
LEGACY_KEY = "curriculum_scheduler_legacy"


class DataEfficiencyHooks:
    """The engine's data-efficiency parts, built from the config (each None when off)."""

    def __init__(self, config: Any, train_batch_size: int, micro_batch_size: int) -> None:
        legacy = config.curriculum_learning
        self.curriculum_scheduler_legacy: CurriculumScheduler | None = None
        if legacy.enabled:
            self.curriculum_scheduler_legacy = CurriculumScheduler(legacy.scheduler_config())
        self.curriculum_type = legacy.curriculum_type
        self.random_ltd_config: dict[str, Any] | None = None
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        if config.data_efficiency.random_ltd_enabled:
            section = config.data_efficiency.data_routing.random_ltd.model_dump()
            section.update(global_batch_size=train_batch_size, micro_batch_size=micro_batch_size)
            self.random_ltd_config = section
            self.random_ltd_scheduler = RandomLTDScheduler(section)
        self._takes_seqlen: bool | None = None

    # -- forward ------------------------------------------------------------------------------
    def forward_kwargs(
        self, module: nn.Module, training: bool, global_steps: int, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """``kwargs`` for a forward at ``global_steps``, the schedules moved along."""
        if not training:
            return kwargs
        legacy = self.curriculum_scheduler_legacy
        if legacy is not None:
            difficulty = legacy.update_difficulty(global_steps + 1)
            if self.curriculum_type == "seqlen":
                self._check_takes_seqlen(module)
                kwargs = {**kwargs, SEQLEN_KWARG: difficulty}
        if self.random_ltd_scheduler is not None:
            self.random_ltd_scheduler.update_seq(global_steps)
        return kwargs

    def _check_takes_seqlen(self, module: nn.Module) -> None:
        if self._takes_seqlen is None:
            params = inspect.signature(module.forward).parameters.values()
            self._takes_seqlen = any(
                p.name == SEQLEN_KWARG or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
            )
        if not self._takes_seqlen:
            raise TypeError(
                f"curriculum_learning (seqlen) is enabled: the engine passes "
                f"{SEQLEN_KWARG}=<scheduled length> to the model's forward, as DeepSpeed does, "
                f"but {type(module).__name__}.forward takes no '{SEQLEN_KWARG}'. Add a "
                f"'{SEQLEN_KWARG}=None' parameter and truncate the sequence inputs (tokens, "
                "labels, positions, masks) to that length, or set curriculum_learning.enabled "
                "to false"
            )

    # -- random-LTD layers ----------------------------------------------------------------------
    def random_ltd_initialize(self, module: nn.Module) -> list[RandomLayerTokenDrop]:
        """Configure the :class:`RandomLayerTokenDrop` layers ``random_ltd_layer_id`` names (by
        their order among the wrapped layers); returns them."""
        if self.random_ltd_scheduler is None or self.random_ltd_config is None:
            raise ValueError(
                "random_ltd_initialize(): random-LTD is off; set data_efficiency.enabled, "
                "data_routing.enabled and data_routing.random_ltd.enabled to true"
            )
        config = self.random_ltd_config
        wrapped = [m for m in module.modules() if isinstance(m, RandomLayerTokenDrop)]
        ids = sorted(config["random_ltd_layer_id"])
        missing = [i for i in ids if i >= len(wrapped)]
        if missing:
            raise ValueError(
                f"random_ltd_layer_id {missing}: the model has {len(wrapped)} RandomLayerTokenDrop "
                "layers (convert_to_random_ltd(model, layer_class) wraps them); use ids below that"
            )
        chosen = [wrapped[i] for i in ids]
        for count, layer in enumerate(chosen):
            layer.init_config(config, self.random_ltd_scheduler, count)
        return chosen

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self, loader: Any) -> dict[str, Any]:
        """The states a checkpoint keeps (None for the parts that are off)."""
        sampler = getattr(loader, "data_sampler", None)
        legacy = self.curriculum_scheduler_legacy
        return {
            "random_ltd": None
            if self.random_ltd_scheduler is None
            else self.random_ltd_scheduler.state_dict(),
            "data_sampler": sampler.state_dict()
            if isinstance(sampler, DeepSpeedDataSampler)
            else None,
            LEGACY_KEY: None if legacy is None else legacy.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], loader: Any) -> None:
        """Restore what :meth:`state_dict` saved (parts absent from ``state`` stay as they are).
        A checkpoint is untrusted input: a part whose saved state does not have the shape it
        should raises a ``ValueError`` naming the checkpoint key."""
        parts: list[tuple[str, Any]] = [
            ("random_ltd", self.random_ltd_scheduler),
            ("data_sampler", _sampler(loader)),
            (LEGACY_KEY, self.curriculum_scheduler_legacy),
        ]
        for key, part in parts:
            saved = state.get(key)
            if part is None or not saved:
                continue
            try:
                part.load_state_dict(saved)
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
                raise ValueError(
                    f"the checkpoint's '{key}' state cannot be restored ({type(exc).__name__}: "
                    f"{exc}); the checkpoint is damaged or was saved with another "
                    "data_efficiency / curriculum_learning config; load it with that config, or "
                    "without those sections to start their schedules afresh"
                ) from exc


def _sampler(loader: Any) -> DeepSpeedDataSampler | None:
    sampler = getattr(loader, "data_sampler", None)
    return sampler if isinstance(sampler, DeepSpeedDataSampler) else None
