"""Tiny Hugging Face causal LMs built from configs (hidden 64, 2 layers), same weights per seed;
:func:`trained` gives one trained briefly on a structured token stream (for int8 figures)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers

VOCAB = 256

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, config kwargs)
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 256},
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128},
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 192,  # split 128/64 at tp 2 (tp_grain_size 64)
            "tie_word_embeddings": True,
        },
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_head": 4, "n_positions": 128}),
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
    "opt": ("OPTConfig", "OPTForCausalLM", {"num_attention_heads": 4, "ffn_dim": 128}),
    # Falcon's fused query_key_value in its three layouts: multi-query (the default),
    # head by head (multi_query=False, with biases), per key/value group (new_decoder_architecture)
    "falcon": ("FalconConfig", "FalconForCausalLM", {"num_attention_heads": 8}),
    "falcon-mha": (
        "FalconConfig",
        "FalconForCausalLM",
        {"num_attention_heads": 8, "multi_query": False, "bias": True},
    ),
    "falcon-gqa": (
        "FalconConfig",
        "FalconForCausalLM",
        {"num_attention_heads": 8, "new_decoder_architecture": True, "num_kv_heads": 2},
    ),
    # a vocabulary no tp size divides (as GPT-2's 50257): split unevenly
    "gpt2-odd-vocab": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_head": 4, "n_positions": 128, "vocab_size": 251},
    ),
}


def config(family: str, **overrides: Any) -> Any:
    config_cls, _, kwargs = FAMILIES[family]
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "bos_token_id": 0,
        "eos_token_id": None,
        "pad_token_id": 0,
    }
    if family.startswith("gpt2"):
        common |= {"n_embd": 64, "n_layer": 2, "initializer_range": 0.1}
    else:
        common |= {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "max_position_embeddings": 128,
            "initializer_range": 0.1,
        }
    return getattr(transformers, config_cls)(**(common | kwargs | overrides))


def build(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The family's tiny model in fp32, eval mode, the same weights for the same seed."""
    torch.manual_seed(seed)
    model_cls = getattr(transformers, FAMILIES[family][1])
    model = model_cls(config(family, **overrides)).eval()
    model.requires_grad_(False)
    return model


def prompt(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (batch, length), generator=generator)  # in every vocabulary


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct parameters and persistent buffers (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    tensors = list(module.parameters()) + [
        b for n, b in module.named_buffers() if "inv_freq" not in n
    ]
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def fused(family: str, **config: Any) -> Any:
    """``init_inference`` of the family's model with fused decoding (fp32, 64-token cache)."""
    import shardspeed

    config = {
        "dtype": torch.float32,
        "replace_with_kernel_inject": True,
        "max_out_tokens": 64,
    } | config
    return shardspeed.init_inference(build(family), **config)


def device_of(model: Any) -> torch.device:
    """Where a model (or an inference engine's module) keeps its weights."""
    return next(getattr(model, "module", model).parameters()).device


def greedy(model: Any, ids: torch.Tensor, new_tokens: int = 32) -> torch.Tensor:
    """``new_tokens`` greedy tokens (on the host), the prompt moved to the model's device."""
    out = model.generate(
        ids.to(device_of(model)), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False,
    )  # fmt: skip
    return out[:, ids.shape[1] :].cpu()


def structured_stream(batch: int, length: int, seed: int) -> torch.Tensor:
    """Token sequences from a fixed first-order Markov source over tokens 1..VOCAB-1: each token
    is followed by its first successor with probability 0.7, its second with 0.2, and by a
    uniformly random token otherwise (entropy 1.35 nats per token, so perplexity >= 3.86). The
    successor tables are the same for every seed; ``seed`` picks the sequences."""
    tables = torch.Generator().manual_seed(1234)
    first = torch.randperm(VOCAB - 1, generator=tables) + 1
    second = torch.randperm(VOCAB - 1, generator=tables) + 1
    draws = torch.Generator().manual_seed(seed)
    out = torch.empty(batch, length, dtype=torch.long)
    out[:, 0] = torch.randint(1, VOCAB, (batch,), generator=draws)
    for i in range(1, length):
        previous = out[:, i - 1] - 1
        u = torch.rand(batch, generator=draws)
        uniform = torch.randint(1, VOCAB, (batch,), generator=draws)
        follow = torch.where(u < 0.7, first[previous], second[previous])
        out[:, i] = torch.where(u < 0.9, follow, uniform)
    return out


def trained(family: str, steps: int = 200) -> torch.nn.Module:
    """The family's tiny model after ``steps`` AdamW steps (fp32, 16 x 64 tokens each) on
    :func:`structured_stream`: seeded, so the same weights every time. A random model's logits
    are nearly flat (top-two gap ~0.2), so any weight perturbation flips near-ties; a trained
    one predicts with a margin as real checkpoints do (top-two gap ~1.5)."""
    model = build(family)
    model.load_state_dict(_trained_state(family, steps))
    return model


@functools.cache
def _trained_state(family: str, steps: int) -> dict[str, torch.Tensor]:
    # one thread: these tiny matmuls gain nothing from two, and on a busy machine a second
    # thread's spin-waits make the steps many times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(family, steps)
    finally:
        torch.set_num_threads(threads)


def _train(family: str, steps: int) -> dict[str, torch.Tensor]:
    model = build(family).train()
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        batch = structured_stream(16, 64, seed=100 + step)
        logits = model(batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
