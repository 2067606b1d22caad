"""CSV backend: one file per event name, ``output_path/job_name/<name with / as _>.csv``."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

from shardspeed.monitor.monitor import Event, Monitor, section_of

__all__ = ["CsvMonitor", "csvMonitor"]


class CsvMonitor(Monitor):
    """Appends ``step,value`` rows; a new file starts with the header ``step,<event name>``.

    ``csv_config`` is the ``csv_monitor`` section (or the whole monitor config). The folder is
    created only where the monitor is :attr:`~.Monitor.active` (enabled, global rank 0);
    ``log_dir`` is None elsewhere."""

    def __init__(self, csv_config: Any) -> None:
        csv_config = section_of(csv_config, "csv_monitor")
        super().__init__(csv_config)
        self.output_path: str = csv_config.output_path
        self.job_name: str = csv_config.job_name
        self.log_dir: str | None = None
        if self.active:
            base = self.output_path or os.path.join(os.getcwd(), "csv_monitor")
            self.log_dir = os.path.join(base, self.job_name)
            os.makedirs(self.log_dir, exist_ok=True)

    def path_for(self, name: str) -> str:
        """The file that holds the event ``name``."""
        if self.log_dir is None:
            raise RuntimeError(
                "this csv monitor writes nothing here (disabled, or not global rank 0)"
            )
        return os.path.join(self.log_dir, name.replace("/", "_") + ".csv")

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self.log_dir is None:
            return
        for name, value, step in event_list:
            path = self.path_for(name)
            is_new = not os.path.exists(path)
            # Open per write: events are rare (once per optimizer step) and files stay complete
            # if the job dies.
            with open(path, "a", newline="", encoding="utf-8") as handle:
                writer = csv.writer(handle)
                if is_new:
                    writer.writerow(["step", name])
                writer.writerow([step, value])


csvMonitor = CsvMonitor  # noqa: N816 - DeepSpeed's class name
