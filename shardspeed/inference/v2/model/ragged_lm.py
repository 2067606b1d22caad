"""``RaggedCausalLM``: one forward pass of a Hugging Face causal LM over a ragged batch.

The flat run of new tokens of every sequence in the batch goes through the model's own
submodules (embeddings, norms, projections, MLPs, MoE blocks, the output head) as a
(tokens, hidden) matrix; only attention is replaced: each layer writes the new tokens' keys and
values into the blocked KV cache and runs :func:`paged_attention` over every sequence's cached
tokens. The module holds no cache, no loop and no mode: the engine owns the cache and the batch
metadata and passes them in. Tensor parallelism needs nothing here: AutoTP's row-parallel
linears all-reduce and its vocabulary-parallel head gathers the logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.inference.fused.attention import rotate_half
from shardspeed.inference.fused.fuse_linear import fuse_linears
from shardspeed.inference.quantization import Int8Linear
from shardspeed.inference.v2.ragged.kv_cache import BlockedKVCache
from shardspeed.inference.v2.ragged.paged_attention import (
    RaggedBatchMetadata,
    paged_attention,
    ragged_sdpa_backends,
)

__all__ = ["SUPPORTED_FAMILIES", "RaggedCausalLM"]

# model_type -> layout: "rotary" (Llama-style decoder: q/k/v/o projections, rotary positions,
# RMSNorm, MLP or MoE block) or "gpt2" (fused Conv1D qkv, learned positions, LayerNorm)
_LAYOUTS = {
    "llama": "rotary",
    "mistral": "rotary",
    "qwen2": "rotary",
    "qwen3": "rotary",
    "mixtral": "rotary",
    "gpt2": "gpt2",
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(_LAYOUTS)
# rotary variants whose cos/sin at a position never change (no length-dependent rescaling):
# a table built once and indexed by position gives the very values of a per-step call
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})


# Hugging Face RMSNorm classes that compute weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)
_HF_RMS_NORMS = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm"}
)


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a norm layer; a Hugging Face RMSNorm as ``F.rms_norm`` (one fused
    kernel on CUDA, where the module's own forward launches seven), its arithmetic kept: the
    normalisation in float32, then the cast, then the weight."""
    if type(module).__name__ not in _HF_RMS_NORMS:
        return module(x)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    eps = float(module.variance_epsilon)  # type: ignore[arg-type]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (tokens, heads, head_dim) with ``cos``/``sin`` (tokens, dim)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def _windowed(meta: RaggedBatchMetadata, window: int) -> RaggedBatchMetadata:
    """``meta`` with its mask also hiding keys ``window`` or more positions behind the query
    (Hugging Face's sliding window: key ``k`` is seen from query ``q`` when ``k > q - window``)."""
    if meta.parts:  # each part masks its own queries
        parts = tuple((index, _windowed(part, window)) for index, part in meta.parts)
        return dataclasses.replace(meta, parts=parts)
    query_pos = meta.positions[meta.query_index]  # (seqs, max_new); padding rows: junk
    key_pos = torch.arange(meta.mask.shape[-1], device=meta.mask.device)
    near = key_pos[None, None, :] > query_pos[:, :, None] - window
    mask = meta.mask & near[:, None]
    # padding rows (and only they) may have lost their one visible key: give it back
    mask[..., 0] |= ~mask.any(dim=-1)
    # the plain causal (fresh) path hides nothing behind the query: only while the window
    # reaches back past every query's first key
    fresh = meta.fresh and window >= meta.query_index.shape[1]
    return dataclasses.replace(meta, mask=mask, fresh=fresh)


class RaggedCausalLM(nn.Module):
    """A Hugging Face causal LM of a supported family, run over ragged batches.

    ``forward(input_ids (T,), meta, cache)`` returns the float logits (sequences, vocab) of each
    sequence's last new token. ``num_layers``, ``kv_heads`` (this rank's) and ``head_dim`` size
    the KV cache.
    """

    # Hugging Face's modules, reached by attribute (their classes differ per family)
    hf_model: Any
    base: Any
    layers: Any
    config: Any

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        config: Any = getattr(hf_model, "config", None)
        family = getattr(config, "model_type", None)
        if family not in _LAYOUTS:
            raise ValueError(
                f"inference v2 does not support model_type={family!r} "
                f"({type(hf_model).__name__}); supported families: "
                f"{', '.join(SUPPORTED_FAMILIES)}."
            )
        self.family: str = family
        self.layout = _LAYOUTS[family]
        self.hf_model = hf_model.eval()
        self.config = config
        base: Any
        if self.layout == "gpt2":
            base = self.hf_model.transformer
            layers = base.h
            attn = layers[0].attn
            self.head_dim = int(attn.head_dim)
            self.kv_heads = int(attn.split_size) // self.head_dim
        else:
            base = self.hf_model.model
            layers = base.layers
            attn = layers[0].self_attn
            self.head_dim = int(attn.head_dim)
            self.kv_heads = int(_out_features(attn.k_proj)) // self.head_dim
        # plain attributes, not submodules: they are parts of hf_model (one state_dict entry each)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "layers", layers)
        self.num_layers = len(self.layers)
        self.vocab_size = int(config.vocab_size)
        # learned position tables end; rotary positions do not
        self.max_positions: int | None = int(config.n_positions) if self.layout == "gpt2" else None
        self._windows = [self._sliding_window(layer) for layer in self.layers]
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        # per layer: q/k/v and gate/up as one matmul each where the linears allow it (a plain
        # list, not submodules: the fused weights share the originals' storage)
        self._qkv: list[nn.Module | None] = []
        self._gate_up: list[nn.Module | None] = []
        if self.layout == "rotary":
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self._qkv.append(_fused([attn.q_proj, attn.k_proj, attn.v_proj]))
                gated = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
                parts = [mlp.gate_proj, mlp.up_proj] if gated else []
                self._gate_up.append(_fused(parts) if hasattr(mlp, "act_fn") else None)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's weights."""
        return next(self.hf_model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where the model's weights live."""
        return next(self.hf_model.parameters()).device

    @property
    def smallest_window(self) -> int | None:
        """The narrowest sliding window of any layer (None: every layer attends to the whole
        context)."""
        windows = [w for w in self._windows if w is not None]
        return min(windows) if windows else None

    def _sliding_window(self, layer: Any) -> int | None:
        if self.layout == "gpt2":
            return None
        attn = layer.self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2/3: per layer (None on full layers)
            window = attn.sliding_window
        else:  # Mistral, Mixtral: every layer
            window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: RaggedBatchMetadata,
        cache: BlockedKVCache,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (sequences, vocab), float32, of each sequence's last new token; with
        ``rows``, of those flat token rows instead (len(rows), vocab)."""
        if input_ids.dim() != 1 or input_ids.numel() != meta.num_tokens:
            raise ValueError(
                f"input_ids must be the flat run of the batch's {meta.num_tokens} new tokens, "
                f"got shape {tuple(input_ids.shape)}."
            )
        if cache.num_layers != self.num_layers or cache.kv_heads != self.kv_heads:
            raise ValueError(
                f"the KV cache has {cache.num_layers} layers of {cache.kv_heads} kv heads; the "
                f"model needs {self.num_layers} of {self.kv_heads}."
            )
        metas: dict[int | None, RaggedBatchMetadata] = {None: meta}
        for window in self._windows:
            if window is not None and window not in metas:
                metas[window] = _windowed(meta, window)
        with ragged_sdpa_backends(input_ids.device):
            if self.layout == "gpt2":
                hidden = self._gpt2_layers(input_ids, meta, metas, cache)
                norm = self.base.ln_f
            else:
                hidden = self._rotary_layers(input_ids, meta, metas, cache)
                norm = self.base.norm
        hidden = _norm(norm, self._last_tokens(hidden, meta) if rows is None else hidden[rows])
        logits = self.hf_model.lm_head(hidden)
        return logits.float()

    @staticmethod
    def _last_tokens(hidden: torch.Tensor, meta: RaggedBatchMetadata) -> torch.Tensor:
        """The rows of each sequence's last new token (unembedding only those)."""
        return hidden if meta.last_rows is None else hidden[meta.last_rows]

    def _rotary_layers(
        self,
        input_ids: torch.Tensor,
        meta: RaggedBatchMetadata,
        metas: dict[int | None, RaggedBatchMetadata],
        cache: BlockedKVCache,
    ) -> torch.Tensor:
        hidden = self.base.embed_tokens(input_ids)
        cos, sin = self._rotary(hidden, meta.positions, meta.max_position)
        tokens = hidden.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _norm(layer.input_layernorm, hidden)
            q, k, v = self._project_qkv(i, attn, x)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
                q, k = (
                    _rope(_norm(attn.q_norm, q), cos, sin),
                    _rope(_norm(attn.k_norm, k), cos, sin),
                )
            else:  # q and k side by side in the fused output: one rotary pass over both
                heads = q.shape[1]
                qk = _rope(_qk(q, k), cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            cache.write(i, meta.slots, k, v)
            out = paged_attention(
                q, cache.keys[i], cache.values[i], metas[self._windows[i]], scale=attn.scaling
            )
            hidden = hidden + attn.o_proj(out.reshape(tokens, -1))
            x = _norm(layer.post_attention_layernorm, hidden)
            gate_up = self._gate_up[i] if self._gate_up else None
            if gate_up is not None:
                mlp = layer.mlp
                gate, up = gate_up(x).chunk(2, dim=-1)
                hidden = hidden + mlp.down_proj(mlp.act_fn(gate).mul_(up))
            else:
                # MoE blocks (Mixtral) take (batch, seq, hidden): the flat run is one row
                hidden = hidden + layer.mlp(x[None])[0]
        return hidden

    def _project_qkv(
        self, i: int, attn: Any, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (tokens, heads, head_dim) of layer ``i``: one matmul when fused."""
        tokens = x.shape[0]
        fused = self._qkv[i] if self._qkv else None
        if fused is None:
            q = attn.q_proj(x).view(tokens, -1, self.head_dim)
            k = attn.k_proj(x).view(tokens, -1, self.head_dim)
            v = attn.v_proj(x).view(tokens, -1, self.head_dim)
            return q, k, v
        qkv = fused(x).view(tokens, -1, self.head_dim)
        kv = self.kv_heads
        heads = qkv.shape[1] - 2 * kv
        return qkv[:, :heads], qkv[:, heads : heads + kv], qkv[:, heads + kv :]

    def _rotary(
        self, hidden: torch.Tensor, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, ...]:
        """cos/sin (tokens, head_dim) of the model's own rotary module (its scaling variant
        included) at ``positions`` (at most ``max_position``, known on the host): for a static
        variant, rows of a table made once (grown by doubling) rather than a module call every
        step."""
        rope = self.base.rotary_emb
        if getattr(rope, "rope_type", "default") not in _STATIC_ROPE:
            cos, sin = rope(hidden[None], positions[None])
            return cos[0], sin[0]
        need = max_position + 1
        table = self._rope_table
        if (
            table is None
            or table[0].shape[0] < need
            or table[0].dtype != hidden.dtype
            or table[0].device != hidden.device
        ):
            size = max(need, 2 * table[0].shape[0] if table is not None else 256)
            every = torch.arange(size, device=hidden.device)
            cos, sin = rope(hidden[None], every[None])
            table = self._rope_table = (cos[0], sin[0])
        return table[0][positions], table[1][positions]

    def _gpt2_layers(
        self,
        input_ids: torch.Tensor,
        meta: RaggedBatchMetadata,
        metas: dict[int | None, RaggedBatchMetadata],
        cache: BlockedKVCache,
    ) -> torch.Tensor:
        hidden = self.base.wte(input_ids) + self.base.wpe(meta.positions)
        tokens = hidden.shape[0]
        for i, block in enumerate(self.layers):
            attn = block.attn
            x = block.ln_1(hidden)
            q, k, v = attn.c_attn(x).split(attn.split_size, dim=-1)
            q = q.reshape(tokens, -1, self.head_dim)
            k = k.reshape(tokens, -1, self.head_dim)
            v = v.reshape(tokens, -1, self.head_dim)
            cache.write(i, meta.slots, k, v)
            out = paged_attention(q, cache.keys[i], cache.values[i], meta, scale=attn.scaling)
            hidden = hidden + attn.c_proj(out.reshape(tokens, -1))
            hidden = hidden + block.mlp(block.ln_2(hidden))
        return hidden


def _fused(parts: list[Any]) -> nn.Module | None:
    """``parts`` fused into one linear (:func:`fuse_linears`) when all are plain ``nn.Linear``
    or all :class:`Int8Linear`; None otherwise (AutoTP's sharded linears stay as they are)."""
    if not parts:
        return None
    if all(type(p) is nn.Linear for p in parts) or all(type(p) is Int8Linear for p in parts):
        return fuse_linears(parts)
    return None


def _qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q and k (tokens, heads, head_dim) side by side as one (tokens, heads + kv_heads, ...)
    tensor: a view of the fused projection's output when they are adjacent there, else a copy."""
    heads = q.shape[1]
    if (
        k.data_ptr() == q.data_ptr() + heads * q.stride(1) * q.element_size()
        and q.stride() == k.stride()
    ):
        return q.as_strided((q.shape[0], heads + k.shape[1], q.shape[2]), q.stride())
    return torch.cat((q, k), dim=1)


def _out_features(linear: Any) -> int:
    """Output width of a linear (``nn.Linear``, AutoTP's replacements or a ``Conv1D``)."""
    if hasattr(linear, "out_features"):
        return int(linear.out_features)
    if hasattr(linear, "nf"):
        return int(linear.nf)
    return int(linear.weight.shape[0])
