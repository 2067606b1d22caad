"""Weights & Biases backend (``WANDB_MODE=offline`` keeps the run on disk under ``WANDB_DIR``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardspeed.config.monitor import WandbConfig
from shardspeed.monitor.monitor import Event, Monitor, missing_dependency

__all__ = ["WandbMonitor"]


class WandbMonitor(Monitor):
    """Logs each event as ``{name: value}`` at ``step`` in one run."""

    def __init__(self, wandb_config: WandbConfig) -> None:
        super().__init__(wandb_config)
        try:
            import wandb
        except ImportError as err:
            raise missing_dependency("wandb", "wandb", "wandb") from err
        self._wandb = wandb
        self.run: Any = wandb.init(
            project=wandb_config.project, group=wandb_config.group, entity=wandb_config.team
        )

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            # commit=False batches the events of one step into one history row; wandb commits a
            # row when the step advances and at finish().
            self.run.log({name: value}, step=step, commit=False)

    def close(self) -> None:
        self.run.finish()
