"""``Monitor`` (the backend interface) and ``MonitorMaster`` (the fan-out the engine uses)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from shardspeed import comm
from shardspeed.config.monitor import DeepSpeedMonitorConfig

__all__ = ["Event", "Monitor", "MonitorMaster", "global_rank", "section_of"]

Event = tuple[str, Any, int]
"""``(name, value, step)``; value is a number (tensors are converted with ``float``)."""


def global_rank() -> int:
    """This process's global rank (the launcher's ``RANK`` before the process group exists)."""
    if comm.is_initialized():
        return comm.get_rank()
    return int(os.environ.get("RANK", "0"))


def missing_dependency(package: str, extra: str, section: str) -> ImportError:
    """The error for an enabled backend whose package is not installed."""
    return ImportError(
        f"the '{section}' monitor is enabled but the '{package}' package is not installed; "
        f"install it with `pip install shardspeed[{extra}]` (or `pip install {package}`), or set "
        f'"{section}": {{"enabled": false}} in the config'
    )


def section_of(config: Any, name: str) -> Any:
    """A backend's config section from the section itself or from the whole monitor config
    (``ds_config.monitor_config``, which older DeepSpeed releases passed to the backends)."""
    nested = getattr(config, name, None)
    return nested if nested is not None and hasattr(nested, "enabled") else config


class Monitor(ABC):
    """One logging backend. :class:`MonitorMaster` creates them on global rank 0 only; one
    built directly (as DeepSpeed's tests do, on every rank) is active only where
    :attr:`active`: enabled and on global rank 0. An inactive one creates nothing (no folder,
    no run) and writes nothing."""

    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config
        self.enabled = bool(getattr(monitor_config, "enabled", False))

    @property
    def active(self) -> bool:
        """Whether this backend writes from this process (DeepSpeed writes from global rank 0
        only)."""
        return self.enabled and global_rank() == 0

    @abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        """Record each ``(name, value, step)``."""

    def flush(self) -> None:  # noqa: B027 - optional: backends that buffer override it
        """Push buffered events to storage."""

    def close(self) -> None:
        """Flush and release the backend's resources."""
        self.flush()


def _sections(monitor_config: Any) -> DeepSpeedMonitorConfig:
    if isinstance(monitor_config, DeepSpeedMonitorConfig):
        return monitor_config
    nested = getattr(monitor_config, "monitor_config", None)  # a DeepSpeedConfig
    if isinstance(nested, DeepSpeedMonitorConfig):
        return nested
    names = ("tensorboard", "wandb", "comet", "csv_monitor")
    if isinstance(monitor_config, dict):
        return DeepSpeedMonitorConfig(**{k: v for k, v in monitor_config.items() if k in names})
    found = {k: getattr(monitor_config, k) for k in names if hasattr(monitor_config, k)}
    if not found:
        raise TypeError(
            "MonitorMaster(monitor_config) takes a DeepSpeedConfig, its .monitor_config, or an "
            f"object with tensorboard/wandb/comet/csv_monitor sections; got {type(monitor_config)}"
        )
    return DeepSpeedMonitorConfig(**found)


class MonitorMaster(Monitor):
    """Writes events to every enabled backend, on global rank 0 only (other ranks do nothing)."""

    def __init__(self, monitor_config: Any) -> None:
        sections = _sections(monitor_config)
        super().__init__(sections)
        self.enabled = sections.enabled
        self.tb_monitor: Monitor | None = None
        self.wandb_monitor: Monitor | None = None
        self.comet_monitor: Monitor | None = None
        self.csv_monitor: Monitor | None = None
        if global_rank() != 0 or not self.enabled:
            return
        # Imported here so a disabled backend never needs its package.
        if sections.tensorboard.enabled:
            from shardspeed.monitor.tensorboard import TensorBoardMonitor

            self.tb_monitor = TensorBoardMonitor(sections.tensorboard)
        if sections.wandb.enabled:
            from shardspeed.monitor.wandb import WandbMonitor

            self.wandb_monitor = WandbMonitor(sections.wandb)
        if sections.comet.enabled:
            from shardspeed.monitor.comet import CometMonitor

            self.comet_monitor = CometMonitor(sections.comet)
        if sections.csv_monitor.enabled:
            from shardspeed.monitor.csv_monitor import CsvMonitor

            self.csv_monitor = CsvMonitor(sections.csv_monitor)

    @property
    def backends(self) -> list[Monitor]:
        """The backends this rank writes to (empty off rank 0)."""
        found = (self.tb_monitor, self.wandb_monitor, self.comet_monitor, self.csv_monitor)
        return [m for m in found if m is not None]

    def write_events(self, event_list: Sequence[Event]) -> None:
        if not event_list:
            return
        events = [(name, _number(value), int(step)) for name, value, step in event_list]
        for backend in self.backends:
            backend.write_events(events)

    def flush(self) -> None:
        for backend in self.backends:
            backend.flush()

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def _number(value: Any) -> float:
    item = getattr(value, "item", None)
    return float(item() if callable(item) else value)
