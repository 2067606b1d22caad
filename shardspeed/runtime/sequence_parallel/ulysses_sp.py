"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``: Arctic Long Sequence
Training (ALST, arXiv 2506.13996) for Hugging Face models.

The names live in their own modules and are re-exported here, DeepSpeed's import path.
"""

from __future__ import annotations

from shardspeed.runtime.sequence_parallel.attention_hf import (
    SequenceParallelInputError,
    UlyssesSPAttentionHF,
)
from shardspeed.runtime.sequence_parallel.dataloader_adapter import UlyssesSPDataLoaderAdapter
from shardspeed.runtime.sequence_parallel.fwd_loss_bwd import UlyssesSPFwdLossBwdWithLogits
from shardspeed.runtime.sequence_parallel.tiled_compute import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__: list[str] = [
    "SequenceParallelInputError",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "UlyssesSPFwdLossBwdWithLogits",
    "sequence_tiled_compute",
]
