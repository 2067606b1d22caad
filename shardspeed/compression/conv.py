"""Compression-aware ``nn.Conv2d`` (DeepSpeed's ``Conv2dLayer_Compress``): the shared techniques
plus channel pruning (whole output channels, by kernel L1 norm or learned scores), and the
``BatchNorm2d`` channel shrink that follows a pruned convolution in ``redundancy_clean``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed.compression.techniques import CompressionMixin

__all__ = ["Conv2dLayer_Compress", "shrink_batchnorm"]


def _keep(tensor: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    return tensor.detach().index_select(dim, keep.nonzero().flatten()).clone()


class Conv2dLayer_Compress(CompressionMixin, nn.Conv2d):  # noqa: N801 - DeepSpeed's name
    """``nn.Conv2d`` with quantization, sparse and channel pruning."""

    MASK_KINDS = ("sparse", "channel")
    TECHNIQUES = CompressionMixin.TECHNIQUES | {"channel_pruning"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_compression_state()
        self.channel_pruning_enabled = False
        self.channel_pruning_method: str | None = None
        self.channel_pruning_ratio = 1.0

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> Conv2dLayer_Compress:
        """A compression-aware convolution holding ``conv``'s own parameters."""
        new = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,  # type: ignore[arg-type]
            stride=conv.stride,  # type: ignore[arg-type]
            padding=conv.padding,  # type: ignore[arg-type]
            dilation=conv.dilation,  # type: ignore[arg-type]
            groups=conv.groups,
            bias=False,
            padding_mode=conv.padding_mode,
            device="meta",
        )
        new.weight = conv.weight
        new.bias = conv.bias
        return new

    def enable_channel_pruning(self, ratio: float, method: str) -> None:
        """Keep the top ``ratio`` of the output channels."""
        self.channel_pruning_ratio, self.channel_pruning_method = ratio, method
        self._mask_state("channel", method, (self.out_channels, 1, 1, 1))

    def magnitudes(self, pruning_type: str) -> torch.Tensor:
        weight = self.weight.detach()
        if pruning_type == "channel":
            return weight.abs().sum(dim=(1, 2, 3), keepdim=True)
        return weight.abs()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        weight, bias = self._quantized_sparse_weight(), self.bias
        if self.channel_pruning_enabled and self.channel_pruning_method is not None:
            channels = self.get_mask("channel").reshape(-1)
            weight = weight * channels[:, None, None, None]
            bias = bias * channels if bias is not None else None
        x = self._quantized_input(input, max(1, input.shape[0]))
        return self._conv_forward(x, weight, bias)

    def fix_channel_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        """Without ``mask``: fix this layer's channel pruning and return the kept-channel mask.
        With ``mask`` (the previous convolution's kept channels): remove those input channels."""
        if mask is not None:
            self.weight = nn.Parameter(_keep(self.weight, mask.reshape(-1).bool(), 1))
            self.in_channels = self.weight.shape[1] * self.groups
            return None
        if self.channel_pruning_method is None:
            return None
        keep = self.get_mask("channel").detach().reshape(-1).bool()
        if dim_reduction:
            self.weight = nn.Parameter(_keep(self.weight, keep, 0))
            if self.bias is not None:
                self.bias = nn.Parameter(_keep(self.bias, keep, 0))
            self.out_channels = self.weight.shape[0]
        else:
            with torch.no_grad():
                self.weight.data = self.weight.data * keep[:, None, None, None]
                if self.bias is not None:
                    self.bias.data = self.bias.data * keep
        self._drop_mask("channel")
        return keep


def shrink_batchnorm(bn: nn.BatchNorm2d, mask: torch.Tensor) -> None:
    """Keep only the ``mask`` channels of ``bn`` (it follows a channel-pruned convolution)."""
    keep = mask.reshape(-1).bool()
    if bn.weight is not None:
        bn.weight = nn.Parameter(_keep(bn.weight, keep, 0))
    if bn.bias is not None:
        bn.bias = nn.Parameter(_keep(bn.bias, keep, 0))
    if bn.running_mean is not None and bn.running_var is not None:
        bn.running_mean = _keep(bn.running_mean, keep, 0)
        bn.running_var = _keep(bn.running_var, keep, 0)
    bn.num_features = int(keep.sum())
