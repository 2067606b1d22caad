"""``sparse_attention``: block-sparse attention layouts."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["SparseAttentionConfig"]


class SparseAttentionConfig(DeepSpeedConfigModel):
    """``sparse_attention``: the union of the keys of every mode; each mode reads its own."""

    json_key: ClassVar[str] = "sparse_attention"

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    """Layout family."""
    block: int = Field(default=16, gt=0)
    """Block size."""
    different_layout_per_head: bool = False
    """Give each head its own layout."""
    num_local_blocks: int = Field(default=4, ge=0)
    """Local blocks (fixed)."""
    num_global_blocks: int = Field(default=1, ge=0)
    """Global blocks (fixed, bigbird)."""
    attention: Literal["bidirectional", "unidirectional"] = "bidirectional"
    """Attention direction."""
    horizontal_global_attention: bool = False
    """Global blocks also attend horizontally."""
    num_different_global_patterns: int = Field(default=1, ge=1)
    """Distinct global patterns across heads (fixed)."""
    num_random_blocks: int = Field(default=0, ge=0)
    """Random blocks (variable, bigbird)."""
    local_window_blocks: list[int] = Field(default_factory=lambda: [4])
    """Local window sizes in blocks (variable)."""
    global_block_indices: list[int] = Field(default_factory=lambda: [0])
    """Global block indices (variable, bslongformer)."""
    global_block_end_indices: list[int] | None = None
    """Ends of global block ranges (variable, bslongformer)."""
    num_sliding_window_blocks: int = Field(default=3, ge=0)
    """Sliding-window blocks (bigbird, bslongformer)."""
