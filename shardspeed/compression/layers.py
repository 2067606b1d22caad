"""Compression-aware ``nn.Linear`` and ``nn.Embedding`` (DeepSpeed's ``LinearLayer_Compress``,
``Embedding_Compress``).

A linear layer adds row pruning (output rows and their bias) and head pruning (the input
columns of an attention output projection, head by head) to the shared techniques. ``fix_*``
either zeroes what was pruned or, with ``dim_reduction``, removes it: the weight shrinks, and the
mask it returns shrinks the related layers (the next layer's input columns, or the Q/K/V rows of
the pruned heads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from shardspeed.compression.prune import head_columns
from shardspeed.compression.techniques import CompressionMixin

__all__ = ["Embedding_Compress", "LinearLayer_Compress"]


def _shrink(tensor: torch.Tensor, keep: torch.Tensor, dim: int) -> nn.Parameter:
    """A new parameter holding ``tensor`` with only the ``keep`` entries along ``dim``."""
    return nn.Parameter(tensor.detach().index_select(dim, keep.nonzero().flatten()).clone())


class LinearLayer_Compress(CompressionMixin, nn.Linear):  # noqa: N801 - DeepSpeed's name
    """``nn.Linear`` with quantization, sparse, row and head pruning."""

    MASK_KINDS = ("sparse", "row", "head")
    TECHNIQUES = CompressionMixin.TECHNIQUES | {"row_pruning", "head_pruning"}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_compression_state()
        self.row_pruning_enabled = False
        self.row_pruning_method: str | None = None
        self.row_pruning_ratio = 1.0
        self.head_pruning_enabled = False
        self.head_pruning_method: str | None = None
        self.head_pruning_ratio = 1.0
        self.num_heads: int | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> LinearLayer_Compress:
        """A compression-aware layer holding ``linear``'s own parameters (ties are kept)."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def extra_repr(self) -> str:
        on = [
            name
            for name in ("sparse", "row", "head")
            if getattr(self, f"{name}_pruning_method") is not None
        ]
        bits = self.weight_quantizer.target_bits if self.weight_quantizer else None
        return f"{super().extra_repr()}, pruning={on}, weight_quantization={bits}"

    # -- configure ---------------------------------------------------------------------------
    def enable_row_pruning(self, ratio: float, method: str) -> None:
        """Keep the top ``ratio`` of the output rows (``l1``: by row L1 norm; ``topk``: learned)."""
        self.row_pruning_ratio, self.row_pruning_method = ratio, method
        self._mask_state("row", method, (self.out_features, 1))

    def enable_head_pruning(self, ratio: float, method: str, num_heads: int) -> None:
        """Keep the top ``ratio`` of ``num_heads`` heads (this layer is the output projection)."""
        head_columns(torch.ones(num_heads), self.in_features)  # num_heads must divide the input
        self.num_heads = num_heads
        self.head_pruning_ratio, self.head_pruning_method = ratio, method
        self._mask_state("head", method, (1, num_heads))

    def magnitudes(self, pruning_type: str) -> torch.Tensor:
        weight = self.weight.detach()
        if pruning_type == "row":
            return weight.abs().sum(dim=1, keepdim=True)
        if pruning_type == "head":
            assert self.num_heads is not None
            return weight.abs().sum(dim=0).reshape(1, self.num_heads, -1).sum(dim=2)
        return weight.abs()

    # -- forward -----------------------------------------------------------------------------
    def compressed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the forward uses now (quantized and masked as switched on)."""
        weight = self._quantized_sparse_weight()
        bias: torch.Tensor | None = self.bias
        if self.row_pruning_enabled and self.row_pruning_method is not None:
            rows = self.get_mask("row").reshape(-1)
            weight = weight * rows[:, None]
            bias = bias * rows if bias is not None else None
        if self.head_pruning_enabled and self.head_pruning_method is not None:
            weight = weight * head_columns(self.get_mask("head"), self.in_features)[None, :]
        return weight, bias

    def forward(self, input: torch.Tensor, skip_bias_add: bool = False) -> Any:  # noqa: A002
        weight, bias = self.compressed_weight()
        x = self._quantized_input(input, max(1, input.numel() // input.shape[-1]))
        if skip_bias_add:  # Megatron-style layers return the bias to add later
            return F.linear(x, weight), bias
        return F.linear(x, weight, bias)

    # -- make permanent ----------------------------------------------------------------------
    def fix_row_col_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        """Without ``mask``: fix this layer's row pruning (remove the rows with
        ``dim_reduction``, else zero them) and return the kept-row mask. With ``mask`` (a
        previous layer's kept rows): remove those input columns here."""
        if mask is not None:
            self.weight = _shrink(self.weight, mask.reshape(-1).bool(), 1)
            self.in_features = self.weight.shape[1]
            return None
        if self.row_pruning_method is None:
            return None
        keep = self.get_mask("row").detach().reshape(-1).bool()
        if dim_reduction:
            self.weight = _shrink(self.weight, keep, 0)
            if self.bias is not None:
                self.bias = _shrink(self.bias, keep, 0)
            self.out_features = self.weight.shape[0]
        else:
            with torch.no_grad():
                self.weight.data = self.weight.data * keep[:, None]
                if self.bias is not None:
                    self.bias.data = self.bias.data * keep
        self._drop_mask("row")
        return keep

    def fix_head_pruning_helper(
        self,
        mask: torch.Tensor | None = None,
        num_heads: int | None = None,
        dim_reduction: bool = False,
    ) -> torch.Tensor | None:
        """Without ``mask``: fix this output projection's head pruning (remove the pruned
        heads' input columns with ``dim_reduction``, else zero them) and return the kept-head
        mask. With ``mask``: remove the pruned heads' output rows (a Q, K or V projection)."""
        heads = num_heads or self.num_heads
        if mask is not None:
            assert heads is not None
            keep_rows = head_columns(mask.reshape(-1).bool(), self.out_features)
            self.weight = _shrink(self.weight, keep_rows, 0)
            if self.bias is not None:
                self.bias = _shrink(self.bias, keep_rows, 0)
            self.out_features = self.weight.shape[0]
            return None
        if self.head_pruning_method is None:
            return None
        keep = self.get_mask("head").detach().reshape(-1).bool()
        columns = head_columns(keep, self.in_features)
        if dim_reduction:
            self.weight = _shrink(self.weight, columns, 1)
            self.in_features = self.weight.shape[1]
        else:
            with torch.no_grad():
                self.weight.data = self.weight.data * columns[None, :]
        self._drop_mask("head")
        return keep


class Embedding_Compress(CompressionMixin, nn.Embedding):  # noqa: N801 - DeepSpeed's name
    """``nn.Embedding`` with weight quantization (one group per token, as DeepSpeed) and
    sparse pruning; its input is token ids, so no activation quantization."""

    TECHNIQUES = frozenset({"weight_quantization", "sparse_pruning"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_compression_state()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> Embedding_Compress:
        """A compression-aware embedding holding ``embedding``'s own weight (ties are kept)."""
        new = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            padding_idx=embedding.padding_idx,
            max_norm=embedding.max_norm,
            norm_type=embedding.norm_type,
            scale_grad_by_freq=embedding.scale_grad_by_freq,
            sparse=embedding.sparse,
            device="meta",
        )
        new.weight = embedding.weight
        return new

    def _weight_groups(self) -> int | None:
        return self.num_embeddings

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        weight = self._quantized_sparse_weight()
        return F.embedding(
            input,
            weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
