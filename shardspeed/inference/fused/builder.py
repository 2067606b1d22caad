"""Build a :class:`FusedCausalLM` from a (sharded, possibly int8) Hugging Face model, or say why
not. Supported: Llama-style models (llama, mistral, qwen2, qwen3) and GPT-2."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed.inference.config import DeepSpeedInferenceConfig
from shardspeed.inference.fused.attention import FusedAttention
from shardspeed.inference.fused.blocks import GatedBlock, PlainBlock
from shardspeed.inference.fused.decoder import CacheShape, FusedCausalLM
from shardspeed.inference.fused.fuse_linear import fuse_linears
from shardspeed.inference.tp_group import TPGroup
from shardspeed.utils.logging import log_dist

__all__ = ["build_fused_decoder"]

_GATED = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def build_fused_decoder(
    model: nn.Module, config: DeepSpeedInferenceConfig, tp: TPGroup, dtype: torch.dtype
) -> FusedCausalLM | None:
    """The fused decoder over ``model``'s weights, or None (with the reason logged)."""
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    capacity = config.max_out_tokens
    if model_type in _GATED:
        reason = _gated_unsupported(model, hf_config, capacity)
        if reason is None:
            return _gated(model, hf_config, capacity, dtype)
    elif model_type == "gpt2":
        reason = _gpt2_unsupported(model, hf_config, capacity)
        if reason is None:
            return _gpt2(model, hf_config, capacity, dtype)
    else:
        reason = f"model_type {model_type!r} has no fused blocks"
    log_dist(f"replace_with_kernel_inject: {reason}; running AutoTP only, unfused", ranks=[0])
    return None


def _gated_unsupported(model: nn.Module, hf_config: Any, capacity: int) -> str | None:
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < capacity:
        return f"sliding-window attention ({window} < max_out_tokens {capacity})"
    rotary = model.get_submodule("model.rotary_emb")
    if getattr(rotary, "rope_type", "default") == "dynamic":
        return "dynamic rotary scaling changes with the sequence length"
    return None


def _gated(model: nn.Module, hf_config: Any, capacity: int, dtype: torch.dtype) -> FusedCausalLM:
    base: Any = model.get_submodule("model")  # Hugging Face modules, by attribute
    blocks: list[nn.Module] = []
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    kv_heads = 0
    for index, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q_heads = attn.q_proj.out_features // head_dim
        kv_heads = attn.k_proj.out_features // head_dim
        norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        fused_attn = FusedAttention(
            fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]),
            attn.o_proj,
            (q_heads, kv_heads, head_dim),
            attn.scaling,
            index,
            norms,
        )
        gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        norm_pair = (layer.input_layernorm, layer.post_attention_layernorm)
        blocks.append(GatedBlock(norm_pair, fused_attn, gate_up, mlp.act_fn, mlp.down_proj))
    positions = torch.arange(capacity, device=_device(model))[None]
    probe = torch.empty(0, dtype=dtype, device=positions.device)
    cos, sin = base.rotary_emb(probe, positions)
    return FusedCausalLM(
        base.embed_tokens,
        blocks,
        base.norm,
        model.get_submodule("lm_head"),
        CacheShape(len(blocks), kv_heads, head_dim, capacity),
        getattr(model, "generation_config", None),
        dtype,
        rope_tables=(cos, sin),
    )


def _gpt2_unsupported(model: nn.Module, hf_config: Any, capacity: int) -> str | None:
    attn = model.get_submodule("transformer.h.0.attn")
    if attn.reorder_and_upcast_attn or attn.scale_attn_by_inverse_layer_idx:
        return "GPT-2 with reorder_and_upcast_attn or scale_attn_by_inverse_layer_idx"
    positions = hf_config.n_positions
    if capacity > positions:
        return f"max_out_tokens {capacity} exceeds the model's {positions} positions"
    return None


def _gpt2(model: nn.Module, hf_config: Any, capacity: int, dtype: torch.dtype) -> FusedCausalLM:
    base: Any = model.get_submodule("transformer")  # Hugging Face modules, by attribute
    head_dim = hf_config.n_embd // hf_config.n_head
    blocks: list[nn.Module] = []
    heads = 0
    for index, layer in enumerate(base.h):
        attn = layer.attn
        heads = attn.c_attn.out_features // (3 * head_dim)
        scale = head_dim**-0.5 if attn.scale_attn_weights else 1.0
        fused_attn = FusedAttention(
            attn.c_attn, attn.c_proj, (heads, heads, head_dim), scale, index
        )
        blocks.append(PlainBlock((layer.ln_1, layer.ln_2), fused_attn, layer.mlp))
    return FusedCausalLM(
        base.wte,
        blocks,
        base.ln_f,
        model.get_submodule("lm_head"),
        CacheShape(len(blocks), heads, head_dim, capacity),
        getattr(model, "generation_config", None),
        dtype,
        positions=base.wpe,
    )


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
