"""Rank side of the UlyssesSPFwdLossBwdWithLogits test, and its position-wise model (no
attention: a slice of the sequence computes what the whole sequence computes for it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed import comm
from shardspeed.runtime.sequence_parallel import parallel_state_sp as mpu
from shardspeed.runtime.sequence_parallel.fwd_loss_bwd import UlyssesSPFwdLossBwdWithLogits

VOCAB, HIDDEN = 24, 12


class ToyLM(nn.Module):
    """Hugging Face's interface: ``forward(input_ids, position_ids, ...)`` returns
    ``.logits``; ``loss_function`` takes ``shift_labels``; ``config.vocab_size``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(32, HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.config = SimpleNamespace(vocab_size=VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **_: Any) -> Any:
        hidden = torch.tanh(self.mlp(self.embed(input_ids) + self.positions(position_ids)))
        return SimpleNamespace(logits=self.lm_head(hidden))

    def loss_function(self, logits, labels, vocab_size, shift_labels=None, **_: Any):
        del labels
        return F.cross_entropy(
            logits.float().reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=-100
        )


def rank_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: 2 x 8 tokens; rank 1: 2 x 6 tokens; some labels ignored."""
    gen = torch.Generator().manual_seed(10 + rank)
    seq = 8 if rank == 0 else 6
    input_ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    labels = input_ids.clone()
    labels[0, : 3 + rank] = -100
    position_ids = torch.arange(seq).expand(2, -1).clone()
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def fwd_loss_bwd(shards: int) -> dict[str, Any]:
    mpu.initialize_sequence_parallel(2)
    model = ToyLM()
    helper = UlyssesSPFwdLossBwdWithLogits(model, model, "cpu", num_loss_logit_shards=shards)
    loss = helper.sp_fwd_loss_bwd(rank_batch(comm.get_rank()))
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
