"""The scheduler's data: what a step reports per token and what it keeps per request."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch

from shardspeed.inference.v2.scheduler.sampling import SamplingParams

__all__ = ["FinishReason", "PromptLogprob", "Request", "ScheduledChunk", "TokenEvent"]

FinishReason = Literal["stop", "length"]
# (token, its log-probability given the tokens before it, the top (token, log-probability))
PromptLogprob = tuple[int, float | None, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of request ``uid``; ``finished`` on its last token, with the reason
    ("stop": a stop/end-of-sequence token, included as ``token``; "length": max_new_tokens).
    When the request asked for ``logprobs``: ``logprob``, the token's log-probability, and
    ``top_logprobs``, the (token, log-probability) of the most likely tokens, most likely
    first. ``prompt_logprobs``, on a request's first token when it asked for them: one
    (token, log-probability, top tokens) per prompt token, the first one's log-probability
    None (nothing predicts it)."""

    uid: int
    token: int
    finished: bool
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    emitted_at: float = 0.0  # time.monotonic() when its step ended (0: not stamped)


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's part of a step's ragged batch: ``length`` tokens from position ``start``;
    ``samples`` when the chunk ends the known tokens, so its logits give a new token (a decode
    token, or the last chunk of a prompt)."""

    uid: int
    start: int
    length: int
    samples: bool

    @property
    def is_decode(self) -> bool:
        """A single token after the prompt (a generated token fed back)."""
        return self.length == 1 and self.samples and self.start > 0


@dataclass
class Request:
    """A request the scheduler holds: its prompt, generated tokens, sampler state and how many of
    its tokens the engine has cached (``computed``; 0 while waiting or after a preemption)."""

    uid: int
    prompt: list[int]
    params: SamplingParams
    arrival: int
    generated: list[int] = field(default_factory=list)
    computed: int = 0
    generator: torch.Generator | None = None
    admitted_at: int | None = None
    preemptions: int = 0
    # prompt log-probabilities found so far (when asked): entry t is prompt token t's
    prompt_entries: list[PromptLogprob] = field(default_factory=list)

    @functools.cached_property
    def prompt_ids(self) -> torch.Tensor:
        """The prompt as a tensor of token ids (made once: repetition penalties read it every
        step)."""
        return torch.tensor(self.prompt, dtype=torch.long)

    @property
    def scores_prompt(self) -> bool:
        """Whether the request still needs log-probabilities of prompt tokens."""
        return self.params.prompt_logprobs is not None and len(self.prompt_entries) < len(
            self.prompt
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the sequence the engine must cache before the next
        sample (all but the last generated token, which is fed on the next step)."""
        return len(self.prompt) + len(self.generated)

    @property
    def pending(self) -> int:
        """How many known tokens the engine has not seen yet."""
        return self.num_tokens - self.computed

    def tokens(self, start: int, length: int) -> list[int]:
        """Tokens ``start .. start + length`` of prompt + generated."""
        # Slices rather than prompt + generated: a decode step must not copy a long history.
        cut = len(self.prompt)
        if start >= cut:
            return self.generated[start - cut : start - cut + length]
        head = self.prompt[start : start + length]
        return head + self.generated[: max(0, start + length - cut)]
