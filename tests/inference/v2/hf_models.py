"""Tiny Hugging Face causal LMs of every family inference v2 supports, built from small configs
(hidden 64, 2 layers, fp32, vocabulary 256, 512 positions) with fixed seeds: no downloads. Shared
by the engine, scheduler and serving tests."""

from __future__ import annotations

import collections
from typing import Any

import torch
from transformers.generation.logits_process import LogitsProcessor

from tests.inference import models

VOCAB = models.VOCAB
MAX_POSITIONS = 512

# inference/models.py's families, shaped for these tests (grouped-query attention in every
# rotary family, 512 positions, no padding row zeroed in the embeddings), plus a
# sliding-window variant (window 8 tokens, far below the prompts used)
SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"intermediate_size": 128},
    "mistral": {},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"intermediate_size": 128},
    "mixtral": {},
    "gpt2": {"n_positions": MAX_POSITIONS},
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("mistral", {"sliding_window": 8}),
}


def _overrides(family: str, overrides: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    base, extra = VARIANTS.get(family, (family, {}))
    positions = {} if base == "gpt2" else {"max_position_embeddings": MAX_POSITIONS}
    return base, {"pad_token_id": None} | positions | SHAPES[base] | extra | overrides


def build(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The family's tiny model in fp32, eval mode, the same weights for the same seed."""
    base, kwargs = _overrides(family, overrides)
    return models.build(base, seed, **kwargs)


def tokens(length: int, seed: int) -> torch.Tensor:
    """``length`` random token ids (1..VOCAB-1), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (length,), generator=generator)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def last_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own logits of the last token of the whole sequence ``ids`` (1-D), on the
    host (the model runs wherever it is: an engine may have moved it to the accelerator)."""
    return model(ids[None].to(_device(model))).logits[0, -1].float().cpu()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **kwargs: Any) -> None:
    """``torch.testing.assert_close`` on the host: an engine's logits come from the accelerator
    when there is one, a reference's from wherever its model was."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **kwargs)


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, **kwargs: Any) -> list[int]:
    """Hugging Face ``generate(do_sample=False)``'s ``new_tokens`` tokens after ``ids`` (1-D);
    ``kwargs`` go to ``generate`` too (penalties, logits processors)."""
    ids = ids.to(_device(model))
    out = model.generate(
        ids[None],
        attention_mask=torch.ones_like(ids[None]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return [int(t) for t in out[0, ids.numel() :]]


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties as a ``generate`` logits processor, written
    out token by token over the tokens after the prompt (``prompt_len`` of them)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len :].tolist()):
            for token, count in collections.Counter(ids).items():
                out[row, token] -= self.frequency * count + self.presence
        return out
