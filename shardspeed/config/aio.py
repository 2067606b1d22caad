"""``aio``: asynchronous NVMe I/O used by ZeRO-Infinity swapping."""

from __future__ import annotations

from typing import ClassVar

from pydantic import AliasChoices, Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["AioConfig"]


class AioConfig(DeepSpeedConfigModel):
    """``aio``: block size, queue depth and threading of NVMe reads and writes."""

    json_key: ClassVar[str] = "aio"

    block_size: int = Field(default=1_048_576, gt=0)
    """I/O block size in bytes."""
    queue_depth: int = Field(default=8, gt=0)
    """Outstanding requests per thread."""
    intra_op_parallelism: int = Field(
        default=1, gt=0, validation_alias=AliasChoices("intra_op_parallelism", "thread_count")
    )
    """I/O threads per operation (DeepSpeed's earlier name for it: ``thread_count``)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Overlap request submission and completion."""
    use_gds: bool = False
    """Use GPUDirect Storage (CUDA only)."""
