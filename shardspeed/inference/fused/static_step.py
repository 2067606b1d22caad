"""A decoding step with fixed shapes and addresses, so that it can be captured in a CUDA graph
(``enable_cuda_graph``) and replayed once per generated token, or compiled once by
``torch.compile`` (:meth:`InferenceEngine.compile`) without ever recompiling."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.inference.fused.kv_cache import StaticKVCache
from shardspeed.inference.graph_capture import capture_step

if TYPE_CHECKING:
    from shardspeed.inference.fused.decoder import FusedCausalLM, Padding

__all__ = ["StaticDecodeStep"]


class StaticDecodeStep:
    """One token per sequence through the fused decoder, on buffers allocated once: the token,
    its position and its cache slot are copied into them, the key and value are written through
    an index tensor, and attention runs over the whole cache with a mask of the slots filled so
    far. With ``graph`` the step is captured in a CUDA graph on its first call and replayed for
    every later token (the captured kernels read the buffers, so new values need no recapture);
    without, it runs eagerly, the same arithmetic on any device."""

    def __init__(
        self,
        model: FusedCausalLM,
        cache: StaticKVCache,
        graph: bool,
        compiler: Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]] | None = None,
    ) -> None:
        device = cache.keys[0].device
        batch, capacity = cache.batch, cache.capacity
        self.model, self.cache, self.use_graph = model, cache, graph
        #: the step as run: compiled by ``compiler`` (e.g. ``torch.compile``) if one is given
        self.compiled = compiler is not None
        self.run_step: Callable[[], torch.Tensor] = (
            self._step if compiler is None else compiler(self._step)
        )
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=device)
        self.slots = torch.arange(capacity, device=device)
        self.padded_positions: torch.Tensor | None = None
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def set_padding(self, padding: Padding | None) -> None:
        """The real-token slots and positions of the batch about to be decoded."""
        self.valid.fill_(True)
        self.padded_positions = None
        if padding is not None:
            self.valid[:, : padding.valid.shape[1]].copy_(padding.valid)
            self.padded_positions = padding.positions

    def __call__(self, token: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits (batch, vocab) of ``token`` (batch,) written at cache slot ``slot``. The
        returned tensor is the step's output buffer: the next call overwrites it."""
        if slot >= self.cache.capacity:
            raise ValueError(
                f"the KV cache holds {self.cache.capacity} tokens and position {slot + 1} was "
                "asked for; raise max_out_tokens in the inference config."
            )
        self.token.copy_(token[:, None])
        self.slot.fill_(slot)
        if self.padded_positions is None:
            self.position.fill_(slot)
        else:
            self.position.copy_(self.padded_positions[:, slot : slot + 1])
        if not self.use_graph:
            return self.run_step()
        if self.graph is None:
            self._capture()
        get_accelerator().replay_graph(self.graph)
        assert self.logits is not None
        return self.logits

    def _step(self) -> torch.Tensor:
        mask = (self.valid & (self.slots <= self.slot))[:, None, None, :]
        return self.model.run(self.token, self.position, self.cache, self.slot, mask)

    def _capture(self) -> None:
        self.graph, self.logits = capture_step(self._step)
