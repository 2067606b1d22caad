"""``compile``: DeepCompile and ``torch.compile`` integration."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["CompileConfig"]


class CompileConfig(DeepSpeedConfigModel):
    """``compile``: which DeepCompile passes run and their memory/sync options."""

    json_key: ClassVar[str] = "compile"

    deepcompile: bool = False
    """Enable DeepCompile."""
    passes: list[Literal["z1", "z3", "autosp"]] | None = None
    """Compiler passes to run."""
    free_activation: bool = False
    """Free activations early."""
    free_activation_threshold: int = Field(default=10 * 1024 * 1024, ge=0)
    """Only free activations larger than this many bytes."""
    offload_activation: bool = False
    """Offload activations to host memory."""
    offload_opt_states: bool = False
    """Offload optimizer states."""
    double_buffer: bool = True
    """Double-buffer parameter gathers."""
    symmetric_memory: bool = False
    """Use symmetric memory for collectives."""
    debug_log: bool = False
    """Log the compiler's decisions."""
    offload_parameters: bool = False
    """Offload parameters."""
    sync_before_reduce: bool = False
    """Synchronize before each reduce."""
    sync_after_reduce: bool = False
    """Synchronize after each reduce."""
    sync_before_allgather: bool = False
    """Synchronize before each all-gather."""
    sync_after_allgather: bool = False
    """Synchronize after each all-gather."""
    keep_int_input_tensors: bool = True
    """Keep integer input tensors alive."""
    keep_all_input_tensors: bool = False
    """Keep every input tensor alive."""
