"""DeepSpeed's ``deepspeed.runtime.zero.parameter_offload``: ZeRO-3's module hooks as
``engine.optimizer.parameter_offload`` exposes them.

Clients reach into this object to run a whole-model forward without ZeRO-3's per-module work.
TRL's ``unwrap_model_for_generation`` (GRPO, RLOO, online DPO, GKD with
``ds3_gather_for_generation=True``) does::

    with deepspeed.zero.GatheredParameters(model.parameters()):   # every unit gathered
        remove_hooks(model)    # clear param.ds_active_sub_modules; .remove() every handle in
                               # forward_hooks and backward_hooks; set both lists to []
        yield model            # generate(): no gather, no release, no collective per module
        add_hooks(model)       # param_coordinator._invalidate_trace() if it is not invalid;
                               # _register_deepspeed_module(module) puts the hooks back

:class:`DeepSpeedZeRoOffload` maps those names onto stage 3's
:class:`~.param_sharding.ParamSharding`: ``forward_hooks`` / ``backward_hooks`` are the
:class:`~.module_hooks.ModuleHook` handles its :class:`~.module_hooks.ModuleHooks` really
installed (per gather unit: gather and release; arm the backward's gather and release),
``_register_deepspeed_module`` re-installs them (idempotent), ``param_coordinator`` is the
look-ahead's recorded order (:class:`~.prefetcher.Prefetcher`), and the modules have
``ds_external_parameters()``.

With the hooks off, the root module's own pre- and post-forward hooks stay (as DeepSpeed's
``fwd_pre_hook`` does): they release nothing a ``GatheredParameters`` block holds. A module whose
parameters are *not* gathered then raises a RuntimeError naming the fix instead of computing on
released (empty) parameters: the guard hook of :mod:`~.module_hooks`; shardspeed does not gather
on demand there, since nothing would release what it gathered.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardspeed.runtime.zero.module_hooks import ModuleHook
from shardspeed.runtime.zero.param_sharding import ParamSharding
from shardspeed.runtime.zero.prefetcher import Prefetcher

__all__ = ["DeepSpeedZeRoOffload", "TraceCoordinator"]


class TraceCoordinator:
    """The part of DeepSpeed's ``PartitionedParameterCoordinator`` clients call: whether the
    recorded module order is invalid, and invalidating it (the next forward and backward record
    it again; until then nothing is gathered ahead)."""

    def __init__(self, prefetcher: Prefetcher) -> None:
        self.prefetcher = prefetcher

    def is_invalid_trace(self) -> bool:
        """No pass recorded since the start or the last :meth:`_invalidate_trace`."""
        return not self.prefetcher.recorded

    def is_complete_trace(self) -> bool:
        """A recorded order exists: passes that follow it gather ahead."""
        return self.prefetcher.recorded

    def _invalidate_trace(self) -> None:
        """Forget the recorded order (a RuntimeError if it is invalid already, as DeepSpeed's)."""
        if self.is_invalid_trace():
            raise RuntimeError("attempted to invalidate already invalid trace")
        self.prefetcher.forget()


class DeepSpeedZeRoOffload:
    """Stage 3's module hooks under DeepSpeed's names (see the module docstring). Built by the
    stage 3 strategy; ``engine.optimizer.parameter_offload`` returns it."""

    def __init__(self, sharding: ParamSharding) -> None:
        self._sharding = sharding
        self.param_coordinator = TraceCoordinator(sharding.prefetcher)

    @property
    def module(self) -> nn.Module:
        """The model whose parameters are partitioned."""
        return self._sharding.module

    @property
    def forward_hooks(self) -> list[ModuleHook]:
        """Each unit's gather (pre-forward) and release (post-forward) hook handles."""
        return self._sharding.hooks.forward_hooks

    @forward_hooks.setter
    def forward_hooks(self, hooks: list[Any]) -> None:
        self._sharding.hooks.forward_hooks = list(hooks)

    @property
    def backward_hooks(self) -> list[ModuleHook]:
        """Each unit's hooks that arm the gather before and the release after its backward."""
        return self._sharding.hooks.backward_hooks

    @backward_hooks.setter
    def backward_hooks(self, hooks: list[Any]) -> None:
        self._sharding.hooks.backward_hooks = list(hooks)

    def get_param_coordinator(self) -> TraceCoordinator:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:
        """(Re)install the hooks of ``module`` and every module inside it, replacing any they
        have (never doubled); for the whole model the recorded order is invalidated first, as
        DeepSpeed does. ``count`` is DeepSpeed's module numbering, unused here."""
        del count
        if module is self.module and not self.param_coordinator.is_invalid_trace():
            self.param_coordinator._invalidate_trace()
        self._sharding.install_hooks(self._sharding.units_in(module))

    def empty_partition_cache(self) -> None:
        """Release every gathered unit (``engine.empty_partition_cache``)."""
        self._sharding.empty_cache()
