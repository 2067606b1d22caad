"""The inference v2 engine's config: ``RaggedInferenceEngineConfig`` and its sections.

Field names and defaults follow DeepSpeed's ``inference/v2/config_v2.py`` and
``ragged/manager_configs.py``; ``kv_block_size`` and ``prefix_caching`` are shardspeed's own.
Like every shardspeed config, an unknown key is an error that names the closest valid key.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar

import torch
from pydantic import Field, field_validator

from shardspeed.config.base import DeepSpeedConfigModel
from shardspeed.config.fieldtypes import FloatDType

__all__ = [
    "AllocationMode",
    "DSStateManagerConfig",
    "MemoryConfig",
    "QuantizationConfig",
    "RaggedInferenceEngineConfig",
    "RaggedTPConfig",
]


class AllocationMode(str, Enum):
    """How the KV cache is sized: ``reserve`` keeps ``size`` bytes free after allocating it,
    ``allocate`` allocates exactly ``size`` blocks."""

    RESERVE = "reserve"
    ALLOCATE = "allocate"


class MemoryConfig(DeepSpeedConfigModel):
    """``state_manager.memory_config``: the KV cache's size."""

    json_key: ClassVar[str] = "state_manager.memory_config"

    mode: AllocationMode = AllocationMode.RESERVE
    size: int = Field(default=1_000_000_000, gt=0)
    """Bytes left free (``reserve``) or number of KV blocks (``allocate``). ``reserve`` never
    takes more blocks than every tracked sequence at ``max_context`` could fill, and on a CPU
    device at most a quarter of the free host memory."""


class DSStateManagerConfig(DeepSpeedConfigModel):
    """``state_manager``: limits on tracked sequences and ragged batches, and the KV cache."""

    json_key: ClassVar[str] = "state_manager"

    max_tracked_sequences: int = Field(default=2048, gt=0)
    """Sequences the engine tracks at once."""
    max_ragged_batch_size: int = Field(default=768, gt=0)
    """Tokens in one ragged batch (one ``put``)."""
    max_ragged_sequence_count: int = Field(default=512, gt=0)
    """Sequences in one ragged batch."""
    max_context: int = Field(default=8192, gt=0)
    """Tokens one sequence may hold (prompt and generated)."""
    memory_config: MemoryConfig = Field(default_factory=MemoryConfig)
    offload: bool = False
    """KV cache offload (not supported: True is refused)."""
    kv_block_size: int = Field(default=64, gt=0)
    """Tokens per KV cache block (shardspeed's own; DeepSpeed fixes it per kernel)."""
    prefix_caching: bool = True
    """Share full KV blocks of identical prompt prefixes between sequences (shardspeed's own)."""

    @field_validator("offload")
    @classmethod
    def _no_offload(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "state_manager.offload=True (KV cache offload) is not supported; set it to False."
            )
        return value


class RaggedTPConfig(DeepSpeedConfigModel):
    """``tensor_parallel``: ranks the model is split across by AutoTP."""

    json_key: ClassVar[str] = "tensor_parallel"

    tp_size: int = Field(default=1, gt=0)
    tp_grain_size: int = Field(default=64, gt=0)
    """MLP shards are multiples of this many columns where the size allows."""


class QuantizationConfig(DeepSpeedConfigModel):
    """``quantization``: DeepSpeed's FP6 weight-only mode needs its CUDA kernels; only no
    quantization is accepted here."""

    json_key: ClassVar[str] = "quantization"

    quantization_mode: str | None = None

    @field_validator("quantization_mode")
    @classmethod
    def _none_only(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(
                f"quantization.quantization_mode={value!r} is not supported by shardspeed's "
                "inference v2 (DeepSpeed's wf6af16 needs its FP6 CUDA kernels); leave it unset."
            )
        return value


class RaggedInferenceEngineConfig(DeepSpeedConfigModel):
    """The whole config of :class:`~shardspeed.inference.v2.engine_v2.InferenceEngineV2`."""

    json_key: ClassVar[str] = ""

    tensor_parallel: RaggedTPConfig = Field(default_factory=RaggedTPConfig, alias="tp")
    state_manager: DSStateManagerConfig = Field(
        default_factory=DSStateManagerConfig, alias="manager"
    )
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    dtype: FloatDType | None = None
    """The model's compute dtype (None: keep the model's own)."""
    kv_cache_dtype: FloatDType | None = None
    """The KV cache's dtype (None: the model's compute dtype)."""
    enable_cuda_graph: bool = False
    """Decode batches and fresh prompts replayed from CUDA graphs, one per padded shape,
    captured on first use or by ``engine.capture_decode_graphs()`` (shardspeed's own; v1's
    setting of the same name); the engine holds one KV block for the prompts' padding. CUDA,
    tp_size 1 and a family whose forward has fixed shapes only: anything else is refused at
    build, naming the reason."""

    def resolved_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype: ``dtype`` or the model's own."""
        return self.dtype if self.dtype is not None else model_dtype
