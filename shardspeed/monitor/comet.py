"""Comet ML backend; ``online: false`` writes an offline experiment archive."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from shardspeed.monitor.monitor import Event, Monitor, missing_dependency, section_of

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    """Logs each event with ``log_metric`` at most once per ``samples_log_interval`` samples.

    ``comet_config`` is the ``comet`` section (or the whole monitor config). The experiment is
    started only where the monitor is :attr:`~.Monitor.active` (enabled, global rank 0);
    ``experiment`` is None elsewhere."""

    def __init__(self, comet_config: Any) -> None:
        comet_config = section_of(comet_config, "comet")
        super().__init__(comet_config)
        self.samples_log_interval = comet_config.samples_log_interval
        self._last_logged: dict[str, int] = {}
        self.experiment: Any = None
        if not self.active:
            return
        try:
            import comet_ml
        except ImportError as err:
            raise missing_dependency("comet_ml", "comet", "comet") from err
        online = True if comet_config.online is None else comet_config.online
        offline_dir = None
        if not online:
            default_dir = os.path.join(os.getcwd(), ".cometml-runs")
            offline_dir = os.environ.get("COMET_OFFLINE_DIRECTORY", default_dir)
        options: dict[str, Any] = {
            "api_key": comet_config.api_key,
            "project": comet_config.project,
            "workspace": comet_config.workspace,
            "experiment_key": comet_config.experiment_key,
            "mode": comet_config.mode or "get_or_create",
            "online": online,
        }
        settings = comet_ml.ExperimentConfig(
            name=comet_config.experiment_name, offline_directory=offline_dir
        )
        # Unset options are left out so comet_ml falls back to COMET_* variables and its files.
        self.experiment = comet_ml.start(
            **{k: v for k, v in options.items() if v is not None}, experiment_config=settings
        )

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self.experiment is None:
            return
        for name, value, step in event_list:
            last = self._last_logged.get(name)
            if last is not None and step - last < self.samples_log_interval:
                continue  # x-axis is samples: submit at most every samples_log_interval
            self._last_logged[name] = step
            self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        if self.experiment is not None:
            self.experiment.end()
