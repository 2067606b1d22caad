"""``compression_scheduler``: switches each technique on at its ``schedule_offset``.

The engine builds one when the config has ``compression_training`` and steps it after every
applied optimizer step (DeepSpeed's order), so the forwards of optimizer step ``t`` (counting
from 0) run with every technique whose offset is ``<= t``; the check at construction turns on
the techniques with offset 0 before the first forward. Weight quantization also moves its bits
along the MoQ schedule at each step.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardspeed.compression.config import CompressionConfigError, get_compression_config
from shardspeed.compression.replace import get_module_name
from shardspeed.compression.techniques import CompressionMixin
from shardspeed.utils.logging import logger

__all__ = ["build_compression_scheduler", "compression_scheduler"]


class compression_scheduler:  # noqa: N801 - DeepSpeed's public name
    """Turns the configured techniques on as the optimizer steps count up."""

    def __init__(self, model: nn.Module, compression_config: Any) -> None:
        self.model = getattr(model, "module", model)
        self.compression_config = get_compression_config(compression_config)
        #: applied optimizer steps so far
        self.training_steps = 0
        self.weight_quantization_enabled = False
        #: technique -> the step it turned on (absent while off)
        self.enabled_at: dict[str, int] = {}
        self.different_compression_methods: dict[str, list[str]] = {}
        self.make_init()

    def make_init(self) -> None:
        """Resolve each enabled technique's module patterns to module names."""
        config = self.compression_config
        for technique in config.enabled_techniques():
            names: list[str] = []
            for group_name, group in config.technique(technique).different_groups.items():
                for pattern in group.modules:
                    found, _ = get_module_name(
                        group_name, self.model, pattern, set(), verbose=False
                    )
                    names.extend(n for n in found if n not in names)
            self.different_compression_methods[technique] = names

    def check_all_modules(self) -> None:
        """Switch on (or move along) every technique whose offset has been reached."""
        for technique, names in self.different_compression_methods.items():
            offset = self.compression_config.technique(technique).shared_parameters.schedule_offset
            if self.training_steps < offset:
                continue
            for name in names:
                module = self.model.get_submodule(name)
                if isinstance(module, CompressionMixin):
                    module.activate(technique, steps_on=self.training_steps - offset)
            if technique not in self.enabled_at:
                self.enabled_at[technique] = self.training_steps
                logger.info(f"{technique} is enabled at step {self.training_steps}")
        self.weight_quantization_enabled = "weight_quantization" in self.enabled_at

    def is_enabled(self, technique: str) -> bool:
        """Whether ``technique`` has been switched on."""
        return technique in self.enabled_at

    def step(self, step_zero_check: bool = False) -> None:
        """Count one applied optimizer step (unless ``step_zero_check``) and update."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()

    def state_dict(self) -> dict[str, Any]:
        """The step count (everything else follows from the config)."""
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s step count."""
        self.training_steps = int(state["training_steps"])
        self.check_all_modules()


def build_compression_scheduler(
    module: nn.Module, compression_training: Any
) -> compression_scheduler | None:
    """The engine's scheduler: None without a ``compression_training`` section or with no
    technique that acts on modules (layer reduction alone happens in ``init_compression``)."""
    if compression_training is None:
        return None
    scheduler = compression_scheduler(module, compression_training)
    if not scheduler.different_compression_methods:
        return None
    prepared = any(isinstance(m, CompressionMixin) for m in scheduler.model.modules())
    if not prepared:
        raise CompressionConfigError(
            "compression_training enables "
            f"{', '.join(scheduler.different_compression_methods)} but the model has no "
            "compression-aware layers: call shardspeed.compression.init_compression(model, "
            "config) before shardspeed.initialize"
        )
    scheduler.step(step_zero_check=True)
    return scheduler
