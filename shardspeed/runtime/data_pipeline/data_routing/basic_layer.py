"""``RandomLayerTokenDrop``: a layer that, in training, sees only a random subset of tokens.

Each training forward draws, per sample, ``k`` token positions (``k`` from the
:class:`~shardspeed.runtime.data_pipeline.data_routing.scheduler.RandomLTDScheduler`), kept in
their original order; gathers those tokens, runs the wrapped layer on them, and scatters its
outputs back to their positions. The dropped tokens skip the layer unchanged (a residual
shortcut), as in DeepSpeed. An attention mask passed by keyword (``model_mask_name``) is cut
to the kept tokens. Evaluation, an unconfigured wrapper, or ``k >= sequence length`` run the
layer on everything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["RandomLayerTokenDrop"]


class RandomLayerTokenDrop(nn.Module):
    """Wraps ``layer`` (kept as ``random_ltd_layer``, DeepSpeed's attribute name); configured
    by :meth:`init_config`, which the engine calls for the layers random-LTD chose."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: Any = None
        self.random_ltd_layer_id = -1
        self.mask_name: str | None = None
        self.model_type = "decoder"
        self.batch_first = True
        self.reserved_length = -1
        #: the kept positions of the last dropping forward, [batch, kept] (for inspection)
        self.last_kept_indices: torch.Tensor | None = None

    def init_config(self, config: dict[str, Any], scheduler: Any, random_ltd_layer_id: int) -> None:
        """Make this layer drop tokens on ``scheduler``'s schedule (``config``: the
        ``random_ltd`` section as a dict)."""
        order = config.get("hidden_state_order", "batch_seq_dim")
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(
                f"random_ltd.hidden_state_order {order!r}: use 'batch_seq_dim' or 'seq_batch_dim'"
            )
        model_type = config.get("model_type", "decoder")
        if model_type not in ("decoder", "encoder"):
            raise ValueError(f"random_ltd.model_type {model_type!r}: use 'decoder' or 'encoder'")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.mask_name = config.get("model_mask_name")
        self.model_type = model_type
        self.batch_first = order == "batch_seq_dim"

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scheduler = self.random_ltd_scheduler
        if scheduler is None or not self.training:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        seq_dim = 1 if self.batch_first else 0
        self.reserved_length = scheduler.get_current_seq()
        seq_len = hidden_states.size(seq_dim)
        if self.reserved_length >= seq_len:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        bsh = hidden_states if self.batch_first else hidden_states.transpose(0, 1)
        batch = bsh.size(0)
        # a random subset per sample, in sequence order (a causal layer keeps its meaning)
        noise = torch.rand(batch, seq_len, device=bsh.device)
        kept = noise.topk(self.reserved_length, dim=1).indices.sort(dim=1).values
        self.last_kept_indices = kept
        index = kept.unsqueeze(-1).expand(-1, -1, bsh.size(-1))
        part = bsh.gather(1, index)
        if self.mask_name is not None and kwargs.get(self.mask_name) is not None:
            kwargs[self.mask_name] = _cut_mask(kwargs[self.mask_name], kept, seq_len)
        outputs = self.random_ltd_layer(
            part if self.batch_first else part.transpose(0, 1), *args, **kwargs
        )
        first = outputs[0] if isinstance(outputs, tuple) else outputs
        if not isinstance(first, torch.Tensor):
            raise TypeError(
                "RandomLayerTokenDrop wraps layers that return the hidden states (or a tuple "
                f"starting with them); {type(self.random_ltd_layer).__name__} returned "
                f"{type(first).__name__}"
            )
        first_bsh = first if self.batch_first else first.transpose(0, 1)
        merged = bsh.scatter(1, index, first_bsh.to(bsh.dtype))
        merged = merged if self.batch_first else merged.transpose(0, 1)
        if isinstance(outputs, tuple):
            return (merged, *outputs[1:])
        return merged


def _cut_mask(mask: torch.Tensor, kept: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``mask`` restricted to the kept positions along each of its trailing sequence dims
    (``[b, 1, s, s]`` -> ``[b, 1, k, k]``, ``[b, s]`` -> ``[b, k]``). Gathering, rather than
    DeepSpeed's ``[:k, :k]`` slice of a decoder mask, is exact for any mask, padding included;
    for a plain causal mask both are the same."""
    batch = kept.size(0)
    if mask.size(0) not in (1, batch):
        raise ValueError(
            f"random-LTD cannot cut an attention mask of shape {tuple(mask.shape)}: its first "
            f"dimension must be the batch ({batch}) or 1"
        )
    if mask.size(0) == 1 and batch > 1:
        mask = mask.expand(batch, *mask.shape[1:])
    for dim in (mask.dim() - 1, mask.dim() - 2):
        if dim < 1 or mask.size(dim) != seq_len:
            continue
        shape = [batch] + [1] * (mask.dim() - 1)
        shape[dim] = kept.size(1)
        index = kept.reshape(shape).expand(
            *[mask.size(i) if i != dim else kept.size(1) for i in range(mask.dim())]
        )
        mask = mask.gather(dim, index)
    return mask
