"""Checkpointing sections: ``checkpoint`` (tag validation, universal load, writer) and ``nebula``."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = [
    "CheckpointConfig",
    "CheckpointParallelWriteConfig",
    "CheckpointWriterConfig",
    "DeepSpeedNebulaConfig",
]


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


class CheckpointParallelWriteConfig(DeepSpeedConfigModel):
    """``checkpoint.parallel_write``."""

    json_key: ClassVar[str] = "checkpoint.parallel_write"

    pipeline_stage: bool = False
    """Each pipeline stage writes its own part in parallel."""


class CheckpointWriterConfig(DeepSpeedConfigModel):
    """``checkpoint.writer``: the file writer used by ``save_checkpoint``."""

    json_key: ClassVar[str] = "checkpoint.writer"

    type: Literal["MOCK", "PYTHON", "FAST"] = "FAST"
    """Writer implementation (case-insensitive)."""
    decoupled: bool = False
    """Write in the background, decoupled from training: ``save_checkpoint`` copies the state to
    the CPU and returns; a background thread writes it; ``engine.wait_for_checkpoint()`` (or the
    next ``save_checkpoint``) waits for it, on every rank, and only then moves ``latest``."""
    io_buffer_size: int = Field(default=64 * 1024**2, gt=0)
    """I/O buffer size in bytes."""
    io_buffer_double: bool = True
    """Double-buffer the I/O."""
    show_statistics: bool = False
    """Log write statistics."""
    data_parallel: Literal["REPLICA", "SOCKET", "MACHINE"] | None = None
    """Which data-parallel ranks write (case-insensitive); None = DeepSpeed's default."""
    io_multiplier: int = Field(default=1, ge=1)
    """I/O parallelism multiplier."""

    _upper_names = field_validator("type", "data_parallel", mode="before")(_upper)


class CheckpointConfig(DeepSpeedConfigModel):
    """``checkpoint``: tag validation, universal checkpoints and the writer."""

    json_key: ClassVar[str] = "checkpoint"

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = "WARN"
    """Check the tag is the same on all ranks: ``Warn``, ``Ignore`` or ``Fail``."""
    load_universal: bool = False
    """Load a universal checkpoint (tag from ``latest_universal``)."""
    use_node_local_storage: bool = False
    """Each node writes to its own local storage."""
    parallel_write: CheckpointParallelWriteConfig = Field(
        default_factory=CheckpointParallelWriteConfig
    )
    """Parallel write settings."""
    checkpoint_serialization: bool = True
    """Use torch serialization for checkpoint files."""
    writer: CheckpointWriterConfig | None = None
    """Checkpoint writer; None uses ``torch.save``."""
    allow_unsafe_pickle: bool = False
    """(shardspeed) Read checkpoint files with full pickle, which can run code named in the file:
    only for a trusted legacy checkpoint holding objects the safe reader refuses. Logged."""
    verify_checksums: bool = False
    """(shardspeed) On load, check every byte of the tag against the CRC-32s in its manifest
    (sizes are always checked); reads the whole tag once more."""

    _upper_tag = field_validator("tag_validation", mode="before")(_upper)

    @property
    def decoupled(self) -> bool:
        """True when saves are written in the background (``writer.decoupled``)."""
        return self.writer is not None and self.writer.decoupled

    @property
    def tag_validation_enabled(self) -> bool:
        """False only for ``Ignore``."""
        return self.tag_validation != "IGNORE"

    @property
    def tag_validation_fail(self) -> bool:
        """True for ``Fail``."""
        return self.tag_validation == "FAIL"


class DeepSpeedNebulaConfig(DeepSpeedConfigModel):
    """``nebula``: the Azure Nebula checkpoint engine (accepted, not implemented)."""

    json_key: ClassVar[str] = "nebula"

    enabled: bool = False
    """Use the Nebula checkpoint engine."""
    persistent_storage_path: str | None = None
    """Where Nebula persists checkpoints."""
    persistent_time_interval: int = 100
    """Seconds between persists."""
    num_of_version_in_retention: int = 2
    """Checkpoint versions kept in memory."""
    enable_nebula_load: bool = True
    """Load through Nebula."""
    load_path: str | None = None
    """Where to load from (default: ``persistent_storage_path``)."""
