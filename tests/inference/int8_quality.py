"""int8 vs fp32 figures on a fixed token stream (shared by the int8 tests)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from tests.inference import models


def quality(reference: Any, quantized: Any) -> dict[str, float]:
    """Weight-byte ratio; logit cosine, perplexity (fp32, int8) and teacher-forced argmax
    agreement on a held-out 4 x 64 sample of the training source
    (:func:`models.structured_stream`, seed 3); greedy tokens equal position by position over
    8 random prompts x 32 new tokens, and the median top-two logit gap of the fp32 model."""
    stream = models.structured_stream(batch=4, length=64, seed=3)
    want, got = reference(stream).logits, quantized(stream).logits
    ids = models.prompt(batch=8)
    greedy_ref, greedy_q = models.greedy(reference, ids), models.greedy(quantized, ids)
    top2 = want.topk(2, dim=-1).values
    return {
        "bytes_ratio": models.weight_bytes(quantized.module) / models.weight_bytes(reference),
        "cosine": F.cosine_similarity(want.flatten(), got.flatten(), dim=0).item(),
        "ppl_fp32": _perplexity(want, stream),
        "ppl_int8": _perplexity(got, stream),
        "argmax_agree": (want.argmax(-1) == got.argmax(-1)).float().mean().item(),
        "greedy_equal": int((greedy_ref == greedy_q).sum().item()),
        "greedy_total": greedy_ref.numel(),
        "median_gap": (top2[..., 0] - top2[..., 1]).median().item(),
    }


def _perplexity(logits: torch.Tensor, stream: torch.Tensor) -> float:
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), stream[:, 1:].reshape(-1))
    return math.exp(loss.item())
