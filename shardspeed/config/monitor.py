"""Monitor sections: ``tensorboard``, ``wandb``, ``comet`` and ``csv_monitor``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
]


class TensorBoardConfig(DeepSpeedConfigModel):
    """``tensorboard``: event files for TensorBoard (needs the ``tensorboard`` package)."""

    json_key: ClassVar[str] = "tensorboard"

    enabled: bool = False
    """Write TensorBoard events."""
    output_path: str = ""
    """Directory of the event files (default: under the launching directory)."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory of ``output_path`` for this job."""


class WandbConfig(DeepSpeedConfigModel):
    """``wandb``: Weights & Biases logging (needs ``wandb``)."""

    json_key: ClassVar[str] = "wandb"

    enabled: bool = False
    """Log to Weights & Biases."""
    group: str | None = None
    """Run group."""
    team: str | None = None
    """Team (entity) name."""
    project: str = "deepspeed"
    """Project name."""


class CometConfig(DeepSpeedConfigModel):
    """``comet``: Comet ML logging (needs ``comet_ml``); unset values fall back to ``COMET_*``."""

    json_key: ClassVar[str] = "comet"

    enabled: bool = False
    """Log to Comet."""
    samples_log_interval: int = Field(default=100, gt=0)
    """Submit metrics every this many samples."""
    project: str | None = None
    """Project (``COMET_PROJECT_NAME``)."""
    workspace: str | None = None
    """Workspace (``COMET_WORKSPACE``)."""
    api_key: str | None = None
    """API key (``COMET_API_KEY``)."""
    experiment_name: str | None = None
    """Experiment name (``COMET_EXPERIMENT_NAME``)."""
    experiment_key: str | None = Field(
        default=None, min_length=32, max_length=50, pattern=r"^[A-Za-z0-9]+$"
    )
    """Alphanumeric key of 32-50 characters (``COMET_EXPERIMENT_KEY``)."""
    online: bool | None = None
    """False stores the run offline (None means online)."""
    mode: Literal["get", "create", "get_or_create"] | None = None
    """``get``, ``create`` or ``get_or_create`` (None means ``get_or_create``)."""


class CSVConfig(DeepSpeedConfigModel):
    """``csv_monitor``: one CSV file per event name."""

    json_key: ClassVar[str] = "csv_monitor"

    enabled: bool = False
    """Write CSV files."""
    output_path: str = ""
    """Directory of the files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory of ``output_path`` for this job."""


class DeepSpeedMonitorConfig(BaseModel):
    """The four monitor sections together, as ``MonitorMaster`` takes them."""

    model_config = ConfigDict(frozen=True)

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)

    @property
    def enabled(self) -> bool:
        """True when any backend is enabled."""
        return any(s.enabled for s in (self.tensorboard, self.wandb, self.comet, self.csv_monitor))
