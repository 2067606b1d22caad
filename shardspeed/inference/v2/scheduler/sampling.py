"""Per-request sampling: the parameters of one request and how its next token is drawn from the
logits of its last position.

Before greedy or sampled choice, ``adjust_logits`` applies a request's logit bias, repetition
penalty and presence/frequency penalties (in Hugging Face's and vLLM's order: bias, then
penalties). Greedy decoding is ``argmax`` (the first of tied maxima, as Hugging Face
``generate``). Sampling applies, in Hugging Face's order, temperature, top-k and top-p to the
logits and draws from their softmax with the request's own ``torch.Generator``, so a request's
tokens depend on its seed and its logits only, never on what else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "SamplingParams",
    "adjust_logits",
    "make_generator",
    "sample",
    "suppress_tokens",
    "warp_logits",
]


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

    Logit adjustments, applied to greedy and sampled choice alike (not to the reported
    log-probabilities): ``logit_bias`` adds its value to each token id's logit (OpenAI's
    ``logit_bias``, Hugging Face's single-token ``sequence_bias``); ``repetition_penalty``
    (1.0: off) divides the positive logits and multiplies the negative ones of every token in
    the prompt or generated so far (Hugging Face's ``repetition_penalty``, as vLLM's);
    ``frequency_penalty`` and ``presence_penalty`` (0: off, -2..2 as OpenAI's) subtract, from
    each token's logit, the penalty times how often it was generated and the penalty once if
    it was (OpenAI's definition: generated tokens only, not the prompt).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(default=128, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    do_sample: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes this request's logits."""
        return bool(self.logit_bias) or (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def reads_logits(self) -> bool:
        """Whether choosing this request's token needs its whole row of logits on the host
        (sampling, log-probabilities, a bias or penalties), not just the row's argmax."""
        return self.do_sample or self.logprobs is not None or self.adjusts_logits

    @model_validator(mode="after")
    def _check_bias(self) -> SamplingParams:
        """Token ids of ``logit_bias`` are ids (>= 0), their biases finite."""
        bad = [t for t, b in self.logit_bias.items() if t < 0 or not math.isfinite(b)]
        if bad:
            raise ValueError(
                f"logit_bias: token id(s) {bad[:4]} are negative or have a non-finite bias; "
                "give token ids >= 0 and finite biases."
            )
        return self

    @model_validator(mode="after")
    def _check_stops(self) -> SamplingParams:
        """Stop token ids are ids (>= 0)."""
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[:4]} are negative; give token ids >= 0.")
        return self

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


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: torch.Tensor, generated: Sequence[int]
) -> torch.Tensor:
    """A float32 copy of one request's ``logits`` (vocab,) after its ``logit_bias``,
    ``repetition_penalty`` (over ``prompt``, its prompt's token ids, and ``generated``) and
    ``frequency_penalty`` / ``presence_penalty`` (over ``generated`` only)."""
    scores = logits.float().clone()
    vocab = scores.shape[0]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=scores.device)
        if int(ids.max()) >= vocab:
            raise ValueError(
                f"logit_bias names token id {int(ids.max())}; the vocabulary has {vocab} tokens."
            )
        bias = torch.tensor(list(params.logit_bias.values()), device=scores.device)
        scores.index_add_(0, ids, bias.to(scores.dtype))
    out = torch.as_tensor(list(generated), dtype=torch.long, device=scores.device)
    if params.repetition_penalty != 1.0:
        seen = torch.cat([prompt.to(device=scores.device, dtype=torch.long), out])
        picked = scores[seen]
        penalty = params.repetition_penalty
        scores[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    if out.numel() and (params.frequency_penalty or params.presence_penalty):
        counts = torch.zeros_like(scores).index_add_(
            0, out, torch.ones_like(out, dtype=scores.dtype)
        )
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return scores


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
