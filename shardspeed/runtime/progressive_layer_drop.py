"""Progressive layer drop (PLD): the keep-probability schedule the engine hands to the model.

PLD (Zhang & He, 2020, https://arxiv.org/abs/2010.13369) skips whole transformer layers at
random during training, fewer early on and more as training settles. The engine's part is only
the schedule: a global keep probability

    theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar

that starts at 1 (keep everything) and decays towards ``theta_bar`` (the config's ``theta``) at
rate ``gamma``. As DeepSpeed does, the engine passes it to the model's ``forward`` as keyword
arguments (``progressive_layer_drop=True, pld_theta=theta``) on every training forward, and
moves it along at each optimizer step; which layers to skip, and with what probability per
depth, is the model's decision (DeepSpeed's BERT example keeps layer ``i`` of ``L`` with
probability ``1 - i / L * (1 - theta)``).
"""

from __future__ import annotations

import math
from typing import Any

from shardspeed.config import DeepSpeedConfig
from shardspeed.utils.logging import log_dist

__all__ = [
    "ProgressiveLayerDrop",
    "build_progressive_layer_drop",
    "refuse_in_pipeline",
    "with_pld_state",
]


class ProgressiveLayerDrop:
    """The PLD schedule: ``theta`` is the final keep probability, ``gamma`` how fast the
    current keep probability (1.0 before the first update) decays towards it."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        theta, gamma = float(theta), float(gamma)
        # the same bounds as the config section, for a schedule built by hand
        if not 0.0 <= theta <= 1.0:
            raise ValueError(
                f"ProgressiveLayerDrop(theta={theta}): theta is a keep probability; "
                "give a value in [0, 1]"
            )
        if gamma < 0.0:
            raise ValueError(
                f"ProgressiveLayerDrop(gamma={gamma}): gamma is a decay rate; give a value >= 0"
            )
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0
        log_dist(f"Enabled progressive layer dropping (theta = {self.theta})", ranks=[0])

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments the engine adds to the model's training forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        """The current keep probability."""
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        """Set the keep probability to the schedule's value at ``global_step``."""
        decay = math.exp(-self.gamma * global_step)
        self.current_theta = (1.0 - self.theta) * decay + self.theta


def build_progressive_layer_drop(config: DeepSpeedConfig) -> ProgressiveLayerDrop | None:
    """The schedule of the ``progressive_layer_drop`` section, or None when it is disabled."""
    section = config.progressive_layer_drop
    if not section.enabled:
        return None
    return ProgressiveLayerDrop(theta=section.theta, gamma=section.gamma)


def with_pld_state(
    pld: ProgressiveLayerDrop | None, training: bool, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``kwargs`` for the model's forward with the PLD state added: only in training mode and
    with PLD enabled (an evaluation forward runs every layer, as in DeepSpeed)."""
    if pld is None or not training:
        return kwargs
    return {**kwargs, **pld.get_state()}


def refuse_in_pipeline(config: DeepSpeedConfig) -> None:
    """Refuse PLD for a PipelineModule. DeepSpeed has no working path there: its pipeline
    stages are called with one input (the extra keywords would not reach the layers) and its
    pipeline step never moves the schedule, so a pipeline run with PLD fails or never drops."""
    if config.progressive_layer_drop.enabled:
        raise ValueError(
            "progressive_layer_drop.enabled=true with a PipelineModule: progressive layer drop "
            "passes its state as keyword arguments to the model's forward, which a pipeline's "
            "stages do not take (DeepSpeed does not support it either); set "
            "progressive_layer_drop.enabled to false, or train the model without a pipeline"
        )
