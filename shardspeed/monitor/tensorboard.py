"""TensorBoard backend: event files under ``output_path/job_name``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from shardspeed.monitor.monitor import Event, Monitor, missing_dependency, section_of

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(Monitor):
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter``.

    ``tensorboard_config`` is the ``tensorboard`` section (or the whole monitor config). The
    writer (and its folder) exists only where the monitor is :attr:`~.Monitor.active`
    (enabled, global rank 0); ``summary_writer`` and ``log_dir`` are None elsewhere."""

    def __init__(self, tensorboard_config: Any) -> None:
        tensorboard_config = section_of(tensorboard_config, "tensorboard")
        super().__init__(tensorboard_config)
        self.output_path: str = tensorboard_config.output_path
        self.job_name: str = tensorboard_config.job_name
        self.log_dir: str | None = None
        self.summary_writer: Any = None
        if not self.active:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch raises this when the tensorboard package is missing
            raise missing_dependency("tensorboard", "tensorboard", "tensorboard") from err
        base = self.output_path or os.path.join(os.getcwd(), "runs")
        self.log_dir = os.path.join(base, self.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list: Sequence[Event], flush: bool = True) -> None:
        if self.summary_writer is None:
            return
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
