"""TensorBoard backend: event files under ``output_path/job_name``."""

from __future__ import annotations

import os
from collections.abc import Sequence

from shardspeed.config.monitor import TensorBoardConfig
from shardspeed.monitor.monitor import Event, Monitor, missing_dependency

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(Monitor):
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, tensorboard_config: TensorBoardConfig) -> None:
        super().__init__(tensorboard_config)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch raises this when the tensorboard package is missing
            raise missing_dependency("tensorboard", "tensorboard", "tensorboard") from err
        base = tensorboard_config.output_path or os.path.join(os.getcwd(), "runs")
        self.log_dir = os.path.join(base, tensorboard_config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list: Sequence[Event], flush: bool = True) -> None:
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()
