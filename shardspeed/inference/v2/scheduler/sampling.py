"""Per-request sampling: the parameters of one request and how its next token is drawn from the
logits of its last position.

Greedy decoding is ``argmax`` (the first of tied maxima, as Hugging Face ``generate``). Sampling
applies, in Hugging Face's order, temperature, top-k and top-p to the logits and draws from their
softmax with the request's own ``torch.Generator``, so a request's tokens depend on its seed and
its logits only, never on what else shares its batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SamplingParams", "make_generator", "sample", "suppress_tokens", "warp_logits"]


class SamplingParams(BaseModel):
    """How one request decodes and when it stops.

    ``max_new_tokens`` caps the generated tokens (finish reason "length"); a token of
    ``stop_token_ids`` or, unless ``ignore_eos``, an end-of-sequence token of the scheduler ends
    the request (finish reason "stop", the stop token included in the output), but neither can be
    drawn before ``min_new_tokens`` tokens exist. ``do_sample=False`` is greedy; otherwise
    ``temperature``, ``top_k`` (0: off) and ``top_p`` (1.0: off) shape the distribution and
    ``seed`` (None: drawn from torch's global generator) seeds the request's own generator.
    ``logprobs`` (None: off) reports each generated token's log-probability and that many of
    the most likely tokens with theirs, from the model's raw distribution (before temperature,
    top-k/top-p and stop-token suppression, as vLLM's default). ``prompt_logprobs`` (None:
    off) does the same for every prompt token after the first (its prompt is then computed
    whole, sharing no cached prefix), reported with the first generated token.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(default=128, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, gt=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    do_sample: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_lengths(self) -> SamplingParams:
        """``min_new_tokens`` must not exceed ``max_new_tokens``."""
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens="
                f"{self.max_new_tokens}; lower min_new_tokens or raise max_new_tokens."
            )
        return self


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``params.seed``, or with a seed drawn from torch's
    global generator when it is None (so ``torch.manual_seed`` still makes a run repeatable)."""
    seed = params.seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` (..., vocab) after temperature, top-k and top-p: removed tokens become -inf.

    Top-k keeps every token at least as large as the k-th largest (ties kept); top-p keeps, in
    falling order, each token whose higher-ranked tokens hold less than ``top_p`` of the
    probability (so the most likely token always stays).
    """
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_above >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def suppress_tokens(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]
) -> torch.Tensor:
    """A copy of ``logits`` (requests, vocab) where token ``tokens[i]`` of request ``rows[i]``
    can never be chosen (-inf): stop tokens before ``min_new_tokens``, as Hugging Face's
    ``MinNewTokensLengthLogitsProcessor`` does, for a whole step's requests at once."""
    out = logits.clone()
    index = (
        torch.as_tensor(list(rows), dtype=torch.long, device=logits.device),
        torch.as_tensor(list(tokens), dtype=torch.long, device=logits.device),
    )
    out[index] = float("-inf")
    return out


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    suppress: Collection[int] = (),
) -> int:
    """The next token of one request from ``logits`` (vocab,) of its last position: ``argmax``
    when greedy, else a draw from the warped distribution with ``generator``. Tokens in
    ``suppress`` (stop tokens before ``min_new_tokens``) are never chosen."""
    if logits.dim() != 1:
        raise ValueError(f"sample takes one request's logits (vocab,), got {tuple(logits.shape)}.")
    scores = logits.float()
    if suppress:
        scores = suppress_tokens(scores[None], [0] * len(suppress), list(suppress))[0]
    if not params.do_sample:
        return int(torch.argmax(scores))
    probs = warp_logits(scores, params).softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
