"""The engine's data-efficiency verbs and queries (DeepSpeed's names); the work is done by
:class:`~shardspeed.runtime.data_pipeline.engine_hooks.DataEfficiencyHooks`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from shardspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from shardspeed.runtime.data_pipeline.engine_hooks import DataEfficiencyHooks

__all__ = ["EngineDataEfficiency"]


class EngineDataEfficiency:
    """Mixed into the engine: needs ``_config``, ``module``, ``training_dataloader`` and the
    ``data_efficiency`` hooks the engine builds."""

    _config: Any
    module: Any
    strategy: Any
    training_dataloader: Any
    data_efficiency: DataEfficiencyHooks

    # -- the parts ----------------------------------------------------------------------------
    @property
    def curriculum_scheduler_legacy(self) -> CurriculumScheduler | None:
        """The legacy seqlen curriculum's schedule (None when ``curriculum_learning`` is off)."""
        return self.data_efficiency.curriculum_scheduler_legacy

    @property
    def random_ltd_scheduler(self) -> RandomLTDScheduler | None:
        """Random-LTD's kept-length schedule (None when random-LTD is off)."""
        return self.data_efficiency.random_ltd_scheduler

    def random_ltd_initialize(self) -> None:
        """Configure the wrapped layers ``random_ltd_layer_id`` names (called by
        ``convert_to_random_ltd(engine, layer_class)``)."""
        self.data_efficiency.random_ltd_initialize(self.module)
        # the wrappers renamed the wrapped layers' parameters (``x.random_ltd_layer.w``)
        self.strategy.registry.rename(self.module)

    def set_custom_curriculum_learning_schedule(
        self, schedule_func_dict: dict[str, Callable[[int], Any]]
    ) -> None:
        """``{metric: fn(step) -> difficulty}`` for the curriculum sampler's custom schedules."""
        sampler = getattr(self.training_dataloader, "data_sampler", None)
        if self.curriculum_learning_enabled() and sampler is not None:
            sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def set_data_post_process_func(self, post_process_func: Callable[..., Any]) -> None:
        """``fn(batch, sampler_state) -> batch`` applied to each curriculum batch."""
        if self.curriculum_learning_enabled() and self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func

    # -- checkpoint ---------------------------------------------------------------------------
    def data_efficiency_state(self) -> dict[str, Any]:
        """The schedulers' and the curriculum sampler's states, for the checkpoint."""
        return self.data_efficiency.state_dict(self.training_dataloader)

    def load_data_efficiency_state(self, state: dict[str, Any]) -> None:
        self.data_efficiency.load_state_dict(state, self.training_dataloader)

    # -- queries (DeepSpeed's getters) ----------------------------------------------------------
    def curriculum_enabled_legacy(self) -> bool:
        return bool(self._config.curriculum_learning.enabled)

    def curriculum_params_legacy(self) -> dict[str, Any]:
        return self._config.curriculum_learning.model_dump(exclude={"enabled"})

    def data_efficiency_enabled(self) -> bool:
        return bool(self._config.data_efficiency.enabled)

    def data_efficiency_config(self) -> dict[str, Any]:
        return self._config.data_efficiency.model_dump()

    def data_sampling_enabled(self) -> bool:
        section = self._config.data_efficiency
        return bool(section.enabled and section.data_sampling.enabled)

    def data_sampling_config(self) -> dict[str, Any]:
        return self._config.data_efficiency.data_sampling.model_dump()

    def curriculum_learning_enabled(self) -> bool:
        return bool(self._config.data_efficiency.curriculum_enabled)

    def curriculum_learning_config(self) -> dict[str, Any]:
        return self._config.data_efficiency.data_sampling.curriculum_learning.model_dump()

    def data_routing_enabled(self) -> bool:
        section = self._config.data_efficiency
        return bool(section.enabled and section.data_routing.enabled)

    def data_routing_config(self) -> dict[str, Any]:
        return self._config.data_efficiency.data_routing.model_dump()

    def random_ltd_enabled(self) -> bool:
        return bool(self._config.data_efficiency.random_ltd_enabled)

    def random_ltd_config(self) -> dict[str, Any]:
        return self._config.data_efficiency.data_routing.random_ltd.model_dump()
