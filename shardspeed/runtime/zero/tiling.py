"""DeepSpeed's ``zero.TiledLinear``: one linear layer as a grid of smaller ones.

Under ZeRO-3 a module's parameters are gathered whole while it runs, so one huge ``Linear``
needs its whole weight on one rank at once. :class:`TiledLinear` splits the input features
into ``in_splits`` parts and the output features into ``out_splits``, with one smaller linear
per (output part, input part) tile: each tile is its own module, gathered and released on its
own, and the output part is the sum of its tiles over the input parts. The result equals the
single layer's (the bias lives in the last input tile of each output part).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.zero.partition_parameters import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_sizes"]


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes as equal as possible (the first ones larger)."""
    if parts < 1 or parts > total:
        raise ValueError(f"cannot split {total} features into {parts} parts (1 to {total})")
    base, extra = divmod(total, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


class TiledLinear(nn.Module):
    """``linear_cls(in_features, out_features, bias)`` as ``out_splits x in_splits`` tiles.

    ``input_is_already_split``: ``forward`` gets a list of ``in_splits`` input parts.
    ``combine_out_splits=False``: ``forward`` returns the list of output parts. ``init_linear``:
    a layer of the full shape to copy the weights from. ``kwargs`` go to ``linear_cls``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: Callable[..., nn.Module] = nn.Linear,
        init_linear: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = split_sizes(in_features, in_splits)
        self.out_parts = split_sizes(out_features, out_splits)
        self.linears = nn.ModuleList(
            nn.ModuleList(
                linear_cls(in_part, out_part, bias=bias and in_id == in_splits - 1, **kwargs)
                for in_id, in_part in enumerate(self.in_parts)
            )
            for out_part in self.out_parts
        )
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def _split_input(self, input_: Any) -> list[torch.Tensor]:
        if self.input_is_already_split:
            parts = list(input_)
            if len(parts) != self.in_splits:
                raise ValueError(
                    f"TiledLinear(input_is_already_split=True) needs {self.in_splits} input "
                    f"parts, got {len(parts)}"
                )
            return parts
        return list(torch.split(input_, self.in_parts, dim=-1))

    def _tile(self, out_id: int, in_id: int, part: torch.Tensor) -> Any:
        return self.linears[out_id][in_id](part)  # type: ignore[index]

    def forward(self, input_: Any) -> Any:
        parts = self._split_input(input_)
        outputs: list[torch.Tensor] = []
        for out_id in range(self.out_splits):
            tiles = [self._tile(out_id, in_id, part) for in_id, part in enumerate(parts)]
            outputs.append(torch.stack(tiles).sum(0) if len(tiles) > 1 else tiles[0])
        return torch.cat(outputs, dim=-1) if self.combine_out_splits else outputs

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other``'s ``weight`` (out_features x in_features) and ``bias`` into the
        tiles (gathered first where ZeRO-3 partitioned them; rank 0's values are kept)."""
        weight: torch.Tensor = other.weight  # type: ignore[assignment]
        bias: torch.Tensor | None = getattr(other, "bias", None)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"init_linear's weight is {tuple(weight.shape)}; this TiledLinear needs "
                f"{(self.out_features, self.in_features)}"
            )
        sources = [weight] + ([bias] if bias is not None else [])
        with (
            GatheredParameters(sources),
            GatheredParameters(list(self.parameters()), modifier_rank=0),
        ):
            for out_id, (out_start, out_size) in enumerate(
                zip(_offsets(self.out_parts), self.out_parts, strict=True)
            ):
                for in_id, (in_start, in_size) in enumerate(
                    zip(_offsets(self.in_parts), self.in_parts, strict=True)
                ):
                    tile: Any = self.linears[out_id][in_id]  # type: ignore[index]
                    tile.weight.copy_(
                        weight[out_start : out_start + out_size, in_start : in_start + in_size]
                    )
                    if tile.bias is not None and bias is not None:
                        tile.bias.copy_(bias[out_start : out_start + out_size])


class TiledLinearReturnBias(TiledLinear):
    """:class:`TiledLinear` over layers that return ``(output, bias)`` (Megatron's style):
    returns ``(output, bias)`` with the output parts summed and concatenated and the bias
    parts concatenated (None without bias)."""

    def forward(self, input_: Any) -> Any:
        parts = self._split_input(input_)
        outputs: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        for out_id in range(self.out_splits):
            pairs = [self._tile(out_id, in_id, part) for in_id, part in enumerate(parts)]
            outputs.append(torch.stack([value for value, _ in pairs]).sum(0))
            present = [b for _, b in pairs if b is not None]
            biases.append(torch.stack(present).sum(0) if present else None)
        if not self.combine_out_splits:
            return outputs, biases
        whole = [b for b in biases if b is not None]
        combined_bias = torch.cat(whole, dim=-1) if len(whole) == len(biases) else None
        return torch.cat(outputs, dim=-1), combined_bias
