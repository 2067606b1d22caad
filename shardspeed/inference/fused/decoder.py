"""``FusedCausalLM``: embeddings, fused blocks, final norm and head over one static KV cache,
with greedy generation that runs the prompt once and then one token per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from shardspeed.inference.fused.attention import Rope, Step
from shardspeed.inference.fused.kv_cache import StaticKVCache
from shardspeed.inference.fused.static_step import StaticDecodeStep

__all__ = ["CacheShape", "DecodeMode", "FusedCausalLM", "Padding"]

DecodeMode = Literal["dynamic", "static", "cuda_graph", "compiled"]
"""How each generated token runs: ``dynamic`` attends over the filled slots only; ``static``
runs :class:`StaticDecodeStep` eagerly (fixed shapes, the whole cache masked); ``cuda_graph``
captures that step in a CUDA graph once and replays it per token (``enable_cuda_graph``)."""

#: generate() arguments the fused loop honours; anything else goes to Hugging Face's generate
ACCEPTED_GENERATE_KWARGS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "max_new_tokens",
        "min_new_tokens",
        "max_length",
        "eos_token_id",
        "pad_token_id",
        "do_sample",
        "num_beams",
        "use_cache",
        "streamer",
    }
)


@dataclass(frozen=True)
class CacheShape:
    """What one rank's KV cache holds per token: layers x kv heads x head_dim."""

    layers: int
    kv_heads: int
    head_dim: int
    capacity: int


@dataclass(frozen=True)
class Padding:
    """A padded batch: which cache slots hold real tokens and each slot's position.

    Positions count real tokens only (Hugging Face's ``cumsum(mask) - 1``), so a left-padded
    prompt starts at position 0 like an unpadded one; generated tokens are always real."""

    valid: torch.Tensor
    """(batch, slots) bool: slot holds a real token."""
    positions: torch.Tensor
    """(batch, slots) position of each slot's token (0 where padded)."""

    @classmethod
    def of(cls, attention_mask: torch.Tensor, slots: int) -> Padding:
        batch, prompt = attention_mask.shape
        valid = torch.ones(batch, slots, dtype=torch.bool, device=attention_mask.device)
        valid[:, :prompt] = attention_mask.bool()
        positions = (valid.long().cumsum(dim=-1) - 1).clamp(min=0)
        return cls(valid, positions)

    def attention_mask(self, start: int, tokens: int) -> torch.Tensor:
        """(batch, 1, tokens, start + tokens): a query attends to earlier real slots and to
        itself (so a padded query has one key and SDPA no empty row)."""
        slots = torch.arange(start + tokens, device=self.valid.device)
        queries = torch.arange(start, start + tokens, device=self.valid.device)[:, None]
        causal = slots[None, :] <= queries
        allowed = causal & self.valid[:, None, : start + tokens]
        return (allowed | (slots[None, :] == queries)).unsqueeze(1)


class FusedCausalLM(nn.Module):
    """A causal LM over fused blocks; the modules are the (sharded, quantized) model's own."""

    def __init__(
        self,
        embed: nn.Module,
        blocks: list[nn.Module],
        norm: nn.Module,
        head: nn.Module,
        cache_shape: CacheShape,
        generation_config: Any,
        dtype: torch.dtype,
        positions: nn.Module | None = None,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.embed, self.positions, self.norm, self.head = embed, positions, norm, head
        self.blocks = nn.ModuleList(blocks)
        self.cache_shape = cache_shape
        self.generation_config = generation_config
        self.rope_tables = rope_tables
        self.dtype = dtype
        self.decode_mode: DecodeMode = "dynamic"
        #: what compiles the static step in the ``"compiled"`` mode (``torch.compile`` with
        #: the options of :meth:`InferenceEngine.compile`)
        self.compiler: Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]] | None = (
            None
        )
        self._cache: StaticKVCache | None = None
        self._static: StaticDecodeStep | None = None

    def cache_for(self, batch: int, dtype: torch.dtype, device: torch.device) -> StaticKVCache:
        """The static cache for ``batch`` sequences, allocated on first use of that batch size."""
        shape = self.cache_shape
        if self._cache is None or not self._cache.fits(batch, shape.capacity, dtype):
            self._cache = self._static = None  # free the old one (a graph holds it) first
            self._cache = StaticKVCache(
                shape.layers, batch, shape.kv_heads, shape.capacity, shape.head_dim, dtype, device
            )
        return self._cache

    def forward(
        self,
        ids: torch.Tensor,
        cache: StaticKVCache,
        start: int,
        all_logits: bool = False,
        padding: Padding | None = None,
    ) -> torch.Tensor:
        """Logits for ``ids`` written at cache slots ``start ...`` (the last token's only unless
        ``all_logits``). Without ``padding`` slot ``i`` is position ``i`` and every slot is a
        real token; with it, positions and the attention mask come from ``padding``."""
        tokens = ids.shape[1]
        if padding is None:
            positions = torch.arange(start, start + tokens, device=ids.device)[None]
            mask = None
        else:
            positions = padding.positions[:, start : start + tokens]
            mask = padding.attention_mask(start, tokens)
        return self.run(ids, positions, cache, start, mask, all_logits)

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticKVCache,
        start: int | torch.Tensor,
        mask: torch.Tensor | None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """The blocks over ``ids`` at ``positions`` (1 or batch, tokens), written at cache slot
        ``start`` (an int, or a one-element tensor for a static step), attending as ``mask``
        allows (None: causal over the filled slots)."""
        x = self.embed(ids)
        if self.positions is not None:
            x = x + self.positions(positions)
        rope: Rope = None
        if self.rope_tables is not None:
            cos, sin = self.rope_tables
            rope = (cos[0][positions], sin[0][positions])
        step = Step(cache, start, rope, mask)
        for block in self.blocks:
            x = block(x, step)
        x = x if all_logits else x[:, -1:]
        logits: torch.Tensor = self.head(self.norm(x))
        return logits if all_logits else logits[:, -1]

    def accepts(self, *inputs: Any, **kwargs: Any) -> bool:
        """Whether a ``generate`` call is greedy decoding this loop runs exactly."""
        if len(inputs) > 1 or not set(kwargs) <= ACCEPTED_GENERATE_KWARGS:
            return False
        ids = inputs[0] if inputs else kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        return (
            isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and not kwargs.get("do_sample")
            and kwargs.get("num_beams") in (None, 1)
            and (mask is None or (isinstance(mask, torch.Tensor) and mask.shape == ids.shape))
        )

    @torch.no_grad()
    def generate(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        """Greedy decoding as Hugging Face's ``generate`` does it: prompt and new tokens. A
        ``streamer`` gets what Hugging Face gives it: ``put(prompt)``, ``put(tokens)`` per step
        (one per sequence), ``end()``."""
        ids: torch.Tensor = inputs[0] if inputs else kwargs["input_ids"]
        streamer = kwargs.get("streamer")
        if streamer is not None:
            streamer.put(ids.cpu())
        batch, prompt = ids.shape
        new, minimum, eos, pad = self._limits(prompt, kwargs, ids.device)
        if prompt + new > self.cache_shape.capacity:
            raise ValueError(
                f"{prompt} prompt + {new} new tokens exceed max_out_tokens="
                f"{self.cache_shape.capacity}; raise max_out_tokens in the inference config."
            )
        cache = self.cache_for(batch, self.dtype, ids.device)
        mask = kwargs.get("attention_mask")
        padding = None if mask is None or bool(mask.all()) else Padding.of(mask, prompt + new)
        logits = self(ids, cache, 0, padding=padding)
        decode = self._decoder(cache, padding)
        done = torch.zeros(batch, dtype=torch.bool, device=ids.device)
        out = []
        for step in range(new):
            if eos is not None and step < minimum:
                logits[:, eos] = float("-inf")
            token = logits.argmax(dim=-1)
            if eos is not None:
                token = torch.where(done, torch.full_like(token, pad), token)
                done |= torch.isin(token, eos)
            out.append(token)
            if streamer is not None:
                streamer.put(token.cpu())
            if (eos is not None and bool(done.all())) or step + 1 == new:
                break
            logits = decode(token, prompt + step)
        if streamer is not None:
            streamer.end()
        return torch.cat([ids, torch.stack(out, dim=1)], dim=1)

    def _decoder(
        self, cache: StaticKVCache, padding: Padding | None
    ) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """The per-token step of :attr:`decode_mode`: ``(token (batch,), slot) -> logits``."""
        if self.decode_mode == "dynamic":
            return lambda token, slot: self(token[:, None], cache, slot, padding=padding)
        use_graph = self.decode_mode == "cuda_graph"
        compiler = self.compiler if self.decode_mode == "compiled" else None
        static = self._static
        if (
            static is None
            or static.cache is not cache
            or static.use_graph != use_graph
            or static.compiled != (compiler is not None)
        ):
            static = self._static = StaticDecodeStep(self, cache, use_graph, compiler)
        static.set_padding(padding)
        return static

    def _limits(
        self, prompt: int, kwargs: dict[str, Any], device: torch.device
    ) -> tuple[int, int, torch.Tensor | None, int]:
        config = self.generation_config
        new = kwargs.get("max_new_tokens")
        if new is None:
            max_length = kwargs.get("max_length") or getattr(config, "max_length", None) or 20
            new = getattr(config, "max_new_tokens", None) if "max_length" not in kwargs else None
            new = new if new is not None else max(max_length - prompt, 0)
        minimum = kwargs.get("min_new_tokens") or getattr(config, "min_new_tokens", None) or 0
        eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
        pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
        if eos is None:
            return new, minimum, None, 0
        eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos), device=device)
        return new, minimum, eos_ids, int(pad if pad is not None else eos_ids[0])
