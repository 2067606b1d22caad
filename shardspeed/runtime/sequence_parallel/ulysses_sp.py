"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``: Arctic Long Sequence
Training (ALST, arXiv 2506.13996) for Hugging Face models.

The names live in their own modules and are re-exported here, DeepSpeed's import path.
"""

from __future__ import annotations

from shardspeed.runtime.sequence_parallel.attention_hf import (
    SequenceParallelInputError,
    UlyssesSPAttentionHF,
)

__all__: list[str] = ["SequenceParallelInputError", "UlyssesSPAttentionHF"]
