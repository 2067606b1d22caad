"""Log-probabilities the scheduler reports: of each sampled token and its top alternatives
(``SamplingParams.logprobs``), and of every prompt token (``prompt_logprobs``), all from the raw
logits (before temperature, top-k/top-p, bias, penalties and stop-token suppression, as vLLM's
default)."""

from __future__ import annotations

import torch

from shardspeed.inference.v2.scheduler.requests import Request, ScheduledChunk

__all__ = ["record_prompt_logprobs", "step_logprobs"]


def _top_pairs(scores: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    """Per row of log-probabilities ``scores``: its ``k`` most likely (token, log-probability),
    most likely first."""
    if not k:
        return [()] * scores.shape[0]
    values, ids = scores.topk(k, dim=-1)
    return [
        tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
    ]


def step_logprobs(
    logits: torch.Tensor, requests: list[Request], chunks: list[ScheduledChunk]
) -> dict[int, tuple[torch.Tensor, tuple[tuple[int, float], ...]]]:
    """For each row whose request asked for ``logprobs`` and samples this step: its
    log-probabilities and its top tokens (one log-softmax and one top-k over those rows of
    the raw logits)."""
    rows = [
        i
        for i, (r, c) in enumerate(zip(requests, chunks, strict=True))
        if c.samples and r.params.logprobs is not None
    ]
    if not rows:
        return {}
    scores = logits[rows].float().log_softmax(dim=-1)
    counts = [int(requests[i].params.logprobs or 0) for i in rows]
    tops = _top_pairs(scores, max(counts))
    return {i: (scores[j], tops[j][: counts[j]]) for j, i in enumerate(rows)}


# rows of a scored chunk's logits turned into log-probabilities at once (bounds the float copy
# to this many rows x vocab)
_SCORE_ROWS = 64


def record_prompt_logprobs(request: Request, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
    """Add the log-probabilities of the prompt tokens that ``chunk``'s positions predict
    (``logits``: one row per chunk token, on the engine's device; position p predicts token
    p + 1), a block of rows at a time, only the picked values leaving the device."""
    prompt, entries = request.prompt, request.prompt_entries
    if not entries:
        entries.append((prompt[0], None, ()))  # the first token has nothing before it
    k = int(request.params.prompt_logprobs or 0)
    # row i predicts prompt token chunk.start + i + 1: from the first not recorded yet (a
    # preempted request recomputes rows it recorded) to the prompt's last
    first = max(0, len(entries) - 1 - chunk.start)
    last = min(chunk.length, len(prompt) - 1 - chunk.start)
    for a in range(first, last, _SCORE_ROWS):
        b = min(a + _SCORE_ROWS, last)
        scores = logits[a:b].float().log_softmax(dim=-1)
        targets = prompt[chunk.start + a + 1 : chunk.start + b + 1]
        index = torch.tensor(targets, device=scores.device)[:, None]
        values = scores.gather(1, index)[:, 0].tolist()
        for token, value, top in zip(targets, values, _top_pairs(scores, k), strict=True):
            entries.append((token, float(value), top))
