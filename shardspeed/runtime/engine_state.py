"""The engine's verbs on the model's state that go to the ZeRO strategy alone: the module's
full state dict in and out, the gathered 16-bit weights, ZeRO-3's partition cache, and states
moved to host memory and back. A mixin of :class:`~shardspeed.runtime.engine.DeepSpeedEngine`;
each verb is one call into the strategy (the verbs that write or read files, through the
checkpointer, stay on the engine)."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from shardspeed.runtime.tensor_parallel.gather import whole_state_dict
from shardspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from shardspeed.runtime.zero.strategy import ZeroStrategy

__all__ = ["EngineStateVerbs"]


class EngineStateVerbs:
    """Module state, gathered weights, partition cache and offloaded states of an engine."""

    strategy: ZeroStrategy
    #: what AutoTP training split (None without ``tensor_parallel.autotp_size``)
    tensor_parallel: Any

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        state = self.strategy.full_state_dict(prefix, keep_vars, exclude_frozen_parameters)
        if destination is not None:
            destination.update(state)
            return destination  # type: ignore[no-any-return]
        return state

    def load_module_state_dict(
        self,
        checkpoint: dict[str, Any],
        strict: bool = True,
        custom_load_fn: Any = None,
        fetch_z3_params: bool = False,
    ) -> None:
        del fetch_z3_params
        module_state = checkpoint.get("module", checkpoint)
        self.strategy.load_full_state_dict(module_state, strict, custom_load_fn)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """The whole module's weights in their training dtype, gathered over the ZeRO-3
        partitions and the tensor-parallel pieces (every rank calls it and gets them; DeepSpeed's
        name, which Accelerate and the HF Trainer call to save a ZeRO-3 model)."""
        state = self.strategy.full_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        return self.whole_tensor_parallel(state)

    def _consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """The whole module's weights in their training dtype when they are split (ZeRO-3 or
        AutoTP; every rank calls it): what Accelerate's ``get_state_dict`` saves under
        ``tensor_parallel.autotp_size``. Raises ValueError when nothing is split, as DeepSpeed
        does (the module's own ``state_dict()`` is whole then)."""
        if self.tensor_parallel is None and self.strategy.stage < 3:
            raise ValueError(
                "_consolidated_16bit_state_dict is only for weights split over ranks (ZeRO "
                "stage 3 or tensor_parallel.autotp_size > 1); use engine.module.state_dict()"
            )
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def whole_tensor_parallel(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a state dict of the module, this rank's tensor-parallel pieces) with every
        AutoTP-split tensor assembled whole; ``state`` itself without AutoTP. Every rank of the
        tensor-parallel group calls it."""
        if self.tensor_parallel is None:
            return state
        module = self.strategy.module
        return whole_state_dict(module, state, self.tensor_parallel.group)

    def empty_partition_cache(self) -> None:
        """Free the ZeRO-3 parameters kept gathered between uses (the persistent small ones);
        they are gathered again when next used. Nothing to free at stages 0-2."""
        self.strategy.empty_partition_cache()

    def offload_states(
        self,
        include: Container[OffloadStateTypeEnum] | None = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move training state (``include``: kinds of
        ``runtime.zero.offload_config.OffloadStateTypeEnum``, None: all) to host memory until
        :meth:`reload_states`; only ``device="cpu"`` is supported, as in DeepSpeed."""
        self.strategy.state_offloader.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move what :meth:`offload_states` moved back where it was."""
        self.strategy.state_offloader.reload(non_blocking)
