"""The techniques every compression-aware layer shares: weight quantization, activation
quantization and sparse (unstructured) pruning, as a mixin over an ``nn.Module`` with a
``weight`` parameter.

A technique is *configured* by ``enable_*`` (at ``init_compression``), switched *on* by the
scheduler at its ``schedule_offset`` (:meth:`CompressionMixin.activate`), and made permanent by
``fix_*`` (``redundancy_clean``). Until it is on, the layer computes exactly as the dense one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardspeed.compression.prune import learned_scores, magnitude_mask, topk_mask
from shardspeed.compression.quantize import (
    QuantizationType,
    Rounding,
    StaticRange,
    fake_quantize,
    quantize,
    scheduled_bits,
)

__all__ = ["ActivationQuantizer", "CompressionMixin", "WeightQuantizer"]


@dataclass
class WeightQuantizer:
    """A layer's weight-quantization settings and its current bits."""

    start_bits: int
    target_bits: int
    period: int
    kind: QuantizationType
    groups: int
    rounding: Rounding = "nearest"
    bits: int = 32  # full precision until the scheduler turns quantization on

    def set_step(self, steps_on: int) -> None:
        """Move the bits along the MoQ schedule (``steps_on`` steps since the offset)."""
        self.bits = scheduled_bits(steps_on, self.start_bits, self.target_bits, self.period)

    def __call__(self, weight: torch.Tensor, groups: int | None = None) -> torch.Tensor:
        return fake_quantize(weight, self.bits, self.kind, groups or self.groups, self.rounding)


class ActivationQuantizer(nn.Module):
    """Input quantization: per-token ranges (``dynamic``) or one running range (``static``)."""

    def __init__(self, bits: int, kind: QuantizationType, range_calibration: str) -> None:
        super().__init__()
        self.bits, self.kind = bits, kind
        self.static = StaticRange() if range_calibration == "static" else None

    def forward(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        if self.static is not None:
            return fake_quantize(x, self.bits, self.kind, 1, value_range=self.static(x))
        return fake_quantize(x, self.bits, self.kind, groups)


class CompressionMixin:
    """Weight/activation quantization and sparse pruning state of a compression-aware layer."""

    weight: torch.Tensor
    #: the structured-mask kinds a layer class supports (``get_mask``)
    MASK_KINDS: tuple[str, ...] = ("sparse",)
    #: the ``compression_training`` techniques a layer class implements
    TECHNIQUES: frozenset[str] = frozenset(
        {"weight_quantization", "activation_quantization", "sparse_pruning"}
    )

    def _init_compression_state(self) -> None:
        self.weight_quantizer: WeightQuantizer | None = None
        self.activation_quantizer: ActivationQuantizer | None = None
        self.weight_quantization_enabled = False
        self.activation_quantization_enabled = False
        self.sparse_pruning_enabled = False
        self.sparse_pruning_method: str | None = None
        self.sparse_pruning_ratio = 1.0

    # -- configure (init_compression) --------------------------------------------------------
    def enable_weight_quantization(
        self,
        start_bits: int,
        target_bits: int,
        quantization_period: int,
        quantization_type: QuantizationType = "symmetric",
        num_groups: int = 1,
        rounding: Rounding = "nearest",
    ) -> None:
        """Quantize the weight from ``start_bits`` down to ``target_bits`` once switched on."""
        self.weight_quantizer = WeightQuantizer(
            start_bits, target_bits, quantization_period, quantization_type, num_groups, rounding
        )

    def enable_activation_quantization(
        self, bits: int, quantization_type: QuantizationType, range_calibration: str
    ) -> None:
        """Quantize the layer's input to ``bits`` once switched on."""
        self.activation_quantizer = ActivationQuantizer(bits, quantization_type, range_calibration)

    def enable_sparse_pruning(self, ratio: float, method: str) -> None:
        """Keep the top ``ratio`` of the weights (``l1``: by magnitude; ``topk``: learned)."""
        self.sparse_pruning_ratio, self.sparse_pruning_method = ratio, method
        self._mask_state("sparse", method, tuple(self.weight.shape))

    def _mask_state(self, kind: str, method: str, score_shape: tuple[int, ...]) -> None:
        # l1: a buffer filled when the technique turns on; topk: learned scores (a parameter
        # the optimizer must see, so init_compression runs before initialize as in DeepSpeed)
        module: Any = self
        module.register_buffer(f"{kind}_pruning_mask", None)
        if method == "topk":
            setattr(module, f"{kind}_mask_scores", learned_scores(score_shape, self.weight))

    # -- switch on (scheduler) ---------------------------------------------------------------
    def activate(self, technique: str, steps_on: int = 0) -> None:
        """Turn ``technique`` on; the scheduler calls this at every step from its offset."""
        if technique == "weight_quantization" and self.weight_quantizer is not None:
            self.weight_quantizer.set_step(steps_on)
            self.weight_quantization_enabled = True
        elif technique == "activation_quantization" and self.activation_quantizer is not None:
            self.activation_quantization_enabled = True
        elif technique.endswith("_pruning"):
            kind = technique.removesuffix("_pruning")
            if getattr(self, f"{kind}_pruning_method", None) is not None:
                if not getattr(self, f"{kind}_pruning_enabled"):
                    self.get_mask(kind)  # l1: the mask of the weights as they are now
                setattr(self, f"{kind}_pruning_enabled", True)

    # -- masks -------------------------------------------------------------------------------
    def get_mask(self, pruning_type: str = "sparse") -> torch.Tensor:
        """The current 0/1 mask of ``pruning_type`` (``sparse``, ``row``, ``head``, ``channel``)."""
        if pruning_type not in self.MASK_KINDS:
            raise ValueError(
                f"{type(self).__name__} has no {pruning_type!r} pruning; it supports "
                f"{', '.join(self.MASK_KINDS)}"
            )
        method = getattr(self, f"{pruning_type}_pruning_method", None)
        ratio = getattr(self, f"{pruning_type}_pruning_ratio")
        if method == "topk":
            return topk_mask(getattr(self, f"{pruning_type}_mask_scores"), ratio)
        if method is None:
            raise ValueError(f"{pruning_type} pruning is not configured on this layer")
        mask = getattr(self, f"{pruning_type}_pruning_mask")
        if mask is None:
            mask = magnitude_mask(self.magnitudes(pruning_type), ratio)
            setattr(self, f"{pruning_type}_pruning_mask", mask)
        return mask  # type: ignore[no-any-return]

    def magnitudes(self, pruning_type: str) -> torch.Tensor:
        """What an ``l1`` mask of ``pruning_type`` ranks (here: each weight's magnitude)."""
        return self.weight.detach().abs()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        # an l1 mask is a buffer only once its technique has turned on: a checkpoint saved
        # after that holds it, and a freshly prepared layer must take it rather than refuse it
        buffers: dict[str, Any] = getattr(self, "_buffers")  # noqa: B009 - nn.Module's
        for kind in self.MASK_KINDS:
            name = f"{kind}_pruning_mask"
            if prefix + name in state_dict and name in buffers and buffers[name] is None:
                buffers[name] = torch.empty_like(state_dict[prefix + name])
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]

    def _drop_mask(self, kind: str) -> None:
        module: Any = self
        for name in (f"{kind}_pruning_mask", f"{kind}_mask_scores"):
            if hasattr(module, name):
                delattr(module, name)
        setattr(self, f"{kind}_pruning_method", None)
        setattr(self, f"{kind}_pruning_enabled", False)

    # -- the forward's pieces ----------------------------------------------------------------
    def _quantized_sparse_weight(self) -> torch.Tensor:
        weight: torch.Tensor = self.weight
        if self.weight_quantization_enabled and self.weight_quantizer is not None:
            weight = self.weight_quantizer(weight, self._weight_groups())
        if self.sparse_pruning_enabled and self.sparse_pruning_method is not None:
            weight = weight * self.get_mask("sparse")
        return weight

    def _weight_groups(self) -> int | None:
        return None  # the configured quantize_groups

    def _quantized_input(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        if self.activation_quantization_enabled and self.activation_quantizer is not None:
            return self.activation_quantizer(x, groups)  # type: ignore[no-any-return]
        return x

    # -- make permanent (redundancy_clean) ---------------------------------------------------
    def fix_weight_quantization(self) -> None:
        """Store the weight quantized at ``target_bits``; the forward stops quantizing."""
        q = self.weight_quantizer
        if q is None:
            return
        with torch.no_grad():
            groups = self._weight_groups() or q.groups
            self.weight.data = quantize(self.weight, q.target_bits, q.kind, groups, "nearest")
        self.weight_quantizer = None
        self.weight_quantization_enabled = False

    def fix_sparse_pruning_helper(self) -> None:
        """Zero the pruned weights for good and drop the mask (and its scores)."""
        if self.sparse_pruning_method is None:
            return
        with torch.no_grad():
            self.weight.data = self.weight.data * self.get_mask("sparse").detach()
        self._drop_mask("sparse")
