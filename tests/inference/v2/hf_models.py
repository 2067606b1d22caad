"""Tiny Hugging Face causal LMs of every family inference v2 supports, built from small configs
(hidden 64, 2 layers, fp32, vocabulary 256, 512 positions) with fixed seeds: no downloads. Shared
by the engine, scheduler and serving tests."""

from __future__ import annotations

from typing import Any

import torch
import transformers

VOCAB = 256
MAX_POSITIONS = 512

# name: (config class, model class, config kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 128},
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "sliding_window": None,
        },
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128},
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 128,
            "tie_word_embeddings": True,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": None,
        },
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_head": 4}),
}
# The sliding-window variant (window 8 tokens, far below the prompts used).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("mistral", {"sliding_window": 8}),
}


def config(family: str, **overrides: Any) -> Any:
    """The family's tiny config (``family`` may name a variant)."""
    if family in VARIANTS:
        family, extra = VARIANTS[family]
        overrides = extra | overrides
    config_cls, _, kwargs = FAMILIES[family]
    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": None}
    if family == "gpt2":
        common |= {"n_embd": 64, "n_layer": 2, "n_positions": MAX_POSITIONS}
    else:
        common |= {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "max_position_embeddings": MAX_POSITIONS,
        }
    common["initializer_range"] = 0.1
    return getattr(transformers, config_cls)(**(common | kwargs | overrides))


def build(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The family's tiny model in fp32, eval mode, the same weights for the same seed."""
    base = VARIANTS[family][0] if family in VARIANTS else family
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[base][1])(config(family, **overrides)).eval()
    model.requires_grad_(False)
    return model


def tokens(length: int, seed: int) -> torch.Tensor:
    """``length`` random token ids (1..VOCAB-1), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (length,), generator=generator)


@torch.no_grad()
def last_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own logits of the last token of the whole sequence ``ids`` (1-D)."""
    return model(ids[None]).logits[0, -1].float()


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """Hugging Face ``generate(do_sample=False)``'s ``new_tokens`` tokens after ``ids`` (1-D)."""
    out = model.generate(
        ids[None],
        attention_mask=torch.ones_like(ids[None]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, ids.numel() :]]
