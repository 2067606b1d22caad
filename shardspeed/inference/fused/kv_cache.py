"""A static KV cache: one preallocated key and value tensor per layer, written in place."""

from __future__ import annotations

import torch

__all__ = ["StaticKVCache"]


class StaticKVCache:
    """Keys and values of ``layers`` layers for ``batch`` sequences of up to ``capacity`` tokens,
    shaped (batch, kv_heads, capacity, head_dim); allocated once (zeroed: a static decoding step
    attends over every slot, the unused ones masked, and masked garbage could be NaN), never
    grown."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.batch, self.capacity = batch, capacity

    def fits(self, batch: int, length: int, dtype: torch.dtype) -> bool:
        """Whether ``batch`` sequences of ``length`` tokens fit this cache as allocated."""
        return batch == self.batch and length <= self.capacity and self.keys[0].dtype == dtype

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``keys``/``values`` (batch, kv_heads, n, head_dim) at ``start`` and return the
        cached keys and values of positions ``[0, start + n)`` (views, no copy)."""
        stop = start + keys.shape[2]
        if stop > self.capacity:
            raise ValueError(
                f"the KV cache holds {self.capacity} tokens and position {stop} was asked for; "
                "raise max_out_tokens in the inference config."
            )
        self.keys[layer][:, :, start:stop].copy_(keys)
        self.values[layer][:, :, start:stop].copy_(values)
        return self.keys[layer][:, :, :stop], self.values[layer][:, :, :stop]

    def write_at(
        self, layer: int, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one token's ``keys``/``values`` (batch, kv_heads, 1, head_dim) at the slot held
        by the one-element tensor ``slot`` and return the whole cache of the layer: shapes and
        addresses never change, so the step can be captured in a CUDA graph (the caller checks
        the slot against the capacity)."""
        self.keys[layer].index_copy_(2, slot, keys)
        self.values[layer].index_copy_(2, slot, values)
        return self.keys[layer], self.values[layer]
