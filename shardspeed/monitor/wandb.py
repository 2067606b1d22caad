"""Weights & Biases backend (``WANDB_MODE=offline`` keeps the run on disk under ``WANDB_DIR``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardspeed.monitor.monitor import Event, Monitor, missing_dependency, section_of

__all__ = ["WandbMonitor"]


class WandbMonitor(Monitor):
    """Logs each event as ``{name: value}`` at ``step`` in one run.

    ``wandb_config`` is the ``wandb`` section (or the whole monitor config); ``group``, ``team``
    and ``project`` are its values. The run is started only where the monitor is
    :attr:`~.Monitor.active` (enabled, global rank 0); ``run`` is None elsewhere."""

    def __init__(self, wandb_config: Any) -> None:
        wandb_config = section_of(wandb_config, "wandb")
        super().__init__(wandb_config)
        self.group: str | None = wandb_config.group
        self.team: str | None = wandb_config.team
        self.project: str = wandb_config.project
        self.run: Any = None
        if not self.active:
            return
        try:
            import wandb
        except ImportError as err:
            raise missing_dependency("wandb", "wandb", "wandb") from err
        self.run = wandb.init(project=self.project, group=self.group, entity=self.team)

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self.run is None:
            return
        for name, value, step in event_list:
            # commit=False batches the events of one step into one history row; wandb commits a
            # row when the step advances and at finish().
            self.run.log({name: value}, step=step, commit=False)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
