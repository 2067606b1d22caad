"""Rank side of the data loader adapter tests (run on 2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm
from shardspeed.runtime.sequence_parallel import parallel_state_sp as mpu
from shardspeed.runtime.sequence_parallel.dataloader_adapter import UlyssesSPDataLoaderAdapter

SEQ = 8


def batches(rank: int, seq: int = SEQ, count: int = 2) -> list[dict[str, Any]]:
    """Rank-dependent HF-style batches: 2 rows, tokens numbered so every batch differs."""
    out = []
    for index in range(count):
        base = 1000 * rank + 100 * index
        input_ids = base + torch.arange(2 * seq).reshape(2, seq)
        labels = input_ids.clone()
        labels[0, :2] = -100
        out.append(
            {
                "input_ids": input_ids,
                "labels": labels,
                "attention_mask": torch.ones(2, seq, dtype=torch.long),
                "row_weight": torch.tensor([1.0, 2.0]) + rank,  # not a sequence: kept whole
                "source": f"rank{rank}-batch{index}",  # not a tensor: passed to all
            }
        )
    return out


def adapt(seq: int = SEQ, pad: bool = True, epochs: int = 1, **extra: Any) -> dict[str, Any]:
    """Run the adapter over this rank's loader; return what it served."""
    mpu.initialize_sequence_parallel(2)
    rank = comm.get_rank()
    data = batches(rank, seq)
    for batch in data:
        batch.update(extra)
    adapter = UlyssesSPDataLoaderAdapter(
        data,
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(),
        device="cpu",
        pad_to_sp_multiple=pad,
        pad_token_id=7,
    )
    served: list[list[dict[str, Any]]] = []
    for _ in range(epochs):
        served.append(list(adapter))
    return {"len": len(adapter), "served": served, "own": data}


def unpadded_refused() -> str:
    try:
        adapt(seq=7, pad=False)
    except ValueError as error:
        return str(error)
    return "no error"


def with_seq_idx() -> list[dict[str, Any]]:
    mpu.initialize_sequence_parallel(2)
    rank = comm.get_rank()
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    data = [
        {
            "input_ids": torch.arange(16).reshape(2, 8),
            "labels": torch.zeros(2, 8, dtype=torch.long),
            "seq_idx": seq_idx,
        }
    ]
    adapter = UlyssesSPDataLoaderAdapter(data, rank, mpu.get_sequence_parallel_group(), 2, "cpu")
    return list(adapter)
