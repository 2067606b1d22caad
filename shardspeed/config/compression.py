"""``compression_training``: quantization, pruning and layer-reduction sections, DeepSpeed's keys.

Each technique has ``shared_parameters`` (``enabled``, ``schedule_offset``, method settings) and
``different_groups`` (name -> ``params``, ``modules`` patterns, ``related_modules``). A section
that is enabled without ``different_groups`` (or a group without its required ``params``) is an
error naming the key, as DeepSpeed asserts it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = [
    "ActivationQuantizationConfig",
    "ChannelPruningConfig",
    "CompressionGroup",
    "CompressionTrainingConfig",
    "HeadPruningConfig",
    "LayerReductionConfig",
    "RowPruningConfig",
    "SparsePruningConfig",
    "WeightQuantizationConfig",
]

#: the techniques that replace modules, in the order ``redundancy_clean`` fixes them (DeepSpeed's)
TECHNIQUES = (
    "weight_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
    "activation_quantization",
)


class _Params(DeepSpeedConfigModel):
    """Per-group settings of one technique (``different_groups.<name>.params``)."""


class WeightQuantizationParams(_Params):
    start_bits: int = Field(ge=1, le=32)
    """Bits when quantization turns on."""
    target_bits: int = Field(ge=1, le=32)
    """Bits at the end of the schedule (one bit less per period, the period doubling each time)."""
    quantization_period: int = Field(default=1, ge=0)
    """Steps before the first one-bit reduction (MoQ: the period doubles after each)."""

    @model_validator(mode="after")
    def _start_above_target(self) -> WeightQuantizationParams:
        if self.start_bits < self.target_bits:
            raise ValueError(
                f"start_bits={self.start_bits} is below target_bits={self.target_bits}; "
                "quantization only lowers the bits: give start_bits >= target_bits"
            )
        return self


class ActivationQuantizationParams(_Params):
    bits: Literal[4, 8]
    """Activation bits (DeepSpeed supports 4 and 8)."""


class DenseRatioParams(_Params):
    dense_ratio: float = Field(gt=0.0, le=1.0)
    """Fraction of weights / rows / heads / channels kept."""


class CompressionGroup(DeepSpeedConfigModel):
    """One entry of ``different_groups``: which modules, with which settings."""

    params: dict[str, Any] = Field(default_factory=dict)
    """The technique's per-group settings (validated by the technique's section)."""
    modules: list[str] = Field(default_factory=lambda: ["*"])
    """Regular expressions searched in module names (``"*"``: every compressible module)."""
    related_modules: list[list[str]] | None = None
    """Per ``modules`` entry, the patterns of the layers whose input dims shrink with it."""

    @field_validator("modules", mode="before")
    @classmethod
    def _one_pattern(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _related_matches_modules(self) -> CompressionGroup:
        if self.related_modules is not None and len(self.related_modules) != len(self.modules):
            raise ValueError(
                f"related_modules has {len(self.related_modules)} entries but modules has "
                f"{len(self.modules)}: give one list of related patterns per modules pattern"
            )
        return self


class _Technique(DeepSpeedConfigModel):
    """A technique: ``shared_parameters`` and ``different_groups``."""

    params_model: ClassVar[type[_Params]] = _Params
    different_groups: dict[str, CompressionGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _groups_when_enabled(self) -> _Technique:
        shared = getattr(self, "shared_parameters")  # noqa: B009 - declared by subclasses
        if shared.enabled and not self.different_groups:
            raise ValueError(
                "the technique is enabled (shared_parameters.enabled=true) but different_groups "
                "is missing or empty: name at least one group with its params and modules"
            )
        for name, group in self.different_groups.items():
            try:
                checked = self.params_model.from_dict(
                    group.params, f"different_groups.{name}.params"
                )
            except ValueError as exc:
                raise ValueError(str(exc)) from None
            group.params = checked.model_dump()
        return self


class WeightQuantizationShared(DeepSpeedConfigModel):
    enabled: bool = False
    quantizer_kernel: bool = False
    """Accepted; shardspeed has no quantizer kernel (the PyTorch quantizer always runs)."""
    schedule_offset: int = Field(default=0, ge=0)
    quantize_groups: int = Field(default=1, ge=1)
    quantize_verbose: bool = False
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    quantize_weight_in_forward: bool = False
    """Accepted; shardspeed always quantizes in the forward (see the module docs)."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    fp16_mixed_quantize: dict[str, Any] = Field(default_factory=dict)
    """Accepted (``enabled``, ``quantize_change_ratio``); shardspeed quantizes fully."""


class WeightQuantizationConfig(_Technique):
    params_model: ClassVar[type[_Params]] = WeightQuantizationParams
    shared_parameters: WeightQuantizationShared = Field(default_factory=WeightQuantizationShared)


class ActivationQuantizationShared(DeepSpeedConfigModel):
    enabled: bool = False
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    schedule_offset: int = Field(default=1000, ge=0)


class ActivationQuantizationConfig(_Technique):
    params_model: ClassVar[type[_Params]] = ActivationQuantizationParams
    shared_parameters: ActivationQuantizationShared = Field(
        default_factory=ActivationQuantizationShared
    )


class SparsePruningShared(DeepSpeedConfigModel):
    enabled: bool = False
    method: Literal["l1", "topk"] = "l1"
    """``l1`` (smallest magnitudes masked) or ``topk`` (learned scores); DeepSpeed's
    ``snip_momentum`` needs Intel Neural Compressor and is not offered."""
    schedule_offset: int = Field(default=1000, ge=0)
    schedule_offset_end: int | None = Field(default=None, ge=0)
    """Accepted (``snip_momentum``'s end step in DeepSpeed); must not precede schedule_offset."""
    schedule_offset_stride: int = Field(default=1, ge=1)
    block_pattern: str = "4x1"
    dense_ratio: float | None = Field(default=None, gt=0.0, lt=1.0)
    excluded_modules: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _end_after_start(self) -> SparsePruningShared:
        if self.schedule_offset_end is not None and self.schedule_offset_end < self.schedule_offset:
            raise ValueError(
                f"schedule_offset_end={self.schedule_offset_end} precedes "
                f"schedule_offset={self.schedule_offset}; give an end at or after the start"
            )
        return self


class SparsePruningConfig(_Technique):
    params_model: ClassVar[type[_Params]] = DenseRatioParams
    shared_parameters: SparsePruningShared = Field(default_factory=SparsePruningShared)


class RowPruningShared(DeepSpeedConfigModel):
    enabled: bool = False
    method: Literal["l1", "topk"] = "l1"
    schedule_offset: int = Field(default=1000, ge=0)


class ChannelPruningShared(RowPruningShared):
    """``channel_pruning.shared_parameters``: the same keys as row pruning's."""


class RowPruningConfig(_Technique):
    params_model: ClassVar[type[_Params]] = DenseRatioParams
    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)


class HeadPruningShared(DeepSpeedConfigModel):
    enabled: bool = False
    method: Literal["topk", "l1"] = "topk"
    """``topk`` (learned head scores, DeepSpeed's only method) or ``l1`` (head column norms)."""
    num_heads: int | None = Field(default=None, ge=1)
    """Attention heads of the output projection the groups name (required when enabled)."""
    schedule_offset: int = Field(default=1000, ge=0)

    @model_validator(mode="after")
    def _heads_when_enabled(self) -> HeadPruningShared:
        if self.enabled and self.num_heads is None:
            raise ValueError(
                "num_heads is required when head pruning is enabled: give the attention "
                "output projection's head count"
            )
        return self


class HeadPruningConfig(_Technique):
    params_model: ClassVar[type[_Params]] = DenseRatioParams
    shared_parameters: HeadPruningShared = Field(default_factory=HeadPruningShared)


class ChannelPruningConfig(_Technique):
    params_model: ClassVar[type[_Params]] = DenseRatioParams
    shared_parameters: ChannelPruningShared = Field(default_factory=ChannelPruningShared)


class LayerReductionConfig(DeepSpeedConfigModel):
    """``layer_reduction``: the student keeps ``keep_number_layer`` layers, initialised from the
    teacher's ``teacher_layer`` ones (and the ``other_module_name`` modules)."""

    enabled: bool = False
    keep_number_layer: int | None = Field(default=None, ge=1)
    module_name_prefix: str | None = None
    """The layers' container, e.g. ``bert.encoder.layer`` or ``transformer.h``."""
    teacher_layer: list[int] = Field(default_factory=list)
    other_module_name: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> LayerReductionConfig:
        if not self.enabled:
            return self
        if not self.module_name_prefix:
            raise ValueError(
                "module_name_prefix is required when layer_reduction is enabled "
                "(e.g. 'bert.encoder.layer' or 'transformer.h')"
            )
        if not self.teacher_layer:
            raise ValueError(
                "teacher_layer is required when layer_reduction is enabled: the teacher's "
                "layer indices the student's layers start from"
            )
        if self.keep_number_layer is not None and self.keep_number_layer != len(self.teacher_layer):
            raise ValueError(
                f"keep_number_layer={self.keep_number_layer} but teacher_layer names "
                f"{len(self.teacher_layer)} layers: give one teacher layer per kept layer"
            )
        return self


class CompressionTrainingConfig(DeepSpeedConfigModel):
    """``compression_training``: every technique off unless its section enables it."""

    json_key: ClassVar[str] = "compression_training"

    weight_quantization: WeightQuantizationConfig = Field(default_factory=WeightQuantizationConfig)
    activation_quantization: ActivationQuantizationConfig = Field(
        default_factory=ActivationQuantizationConfig
    )
    sparse_pruning: SparsePruningConfig = Field(default_factory=SparsePruningConfig)
    row_pruning: RowPruningConfig = Field(default_factory=RowPruningConfig)
    head_pruning: HeadPruningConfig = Field(default_factory=HeadPruningConfig)
    channel_pruning: ChannelPruningConfig = Field(default_factory=ChannelPruningConfig)
    layer_reduction: LayerReductionConfig = Field(default_factory=LayerReductionConfig)

    def technique(self, name: str) -> Any:
        """The section of technique ``name`` (one of :data:`TECHNIQUES`)."""
        return getattr(self, name)

    def enabled_techniques(self) -> list[str]:
        """The enabled techniques that act on modules, in :data:`TECHNIQUES` order."""
        return [t for t in TECHNIQUES if self.technique(t).shared_parameters.enabled]
