"""Built-in AutoTP partition rules for common model families, and the choice among the sources.

The presets hold the same rules as DeepSpeed's ``AutoTPPresets`` (attention and MLP output
projections row-parallel, the projections into them column-parallel, fused weights split per
sub-parameter, MoE gates and low-rank MLA projections left whole). Their patterns end in
``.weight$``: they are matched against parameter names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.runtime.tensor_parallel.specs import (
    AutoTPConfig,
    PartitionType,
    Shape,
    TPLayerSpec,
    merge_autotp_configs,
)

__all__ = ["PRESET_NAMES", "AutoTPPresets", "resolve_autotp_config"]


def _row(pattern: str) -> TPLayerSpec:
    return TPLayerSpec(patterns=[pattern], partition_type=PartitionType.ROW)


def _column(pattern: str, shape: Shape | None = None) -> TPLayerSpec:
    # a packed weight's sub-parameters lie along the output features (dim 0)
    dim = None if shape is None else 0
    return TPLayerSpec(
        patterns=[pattern], partition_type=PartitionType.COLUMN, shape=shape, partition_dim=dim
    )


def _skip(pattern: str) -> TPLayerSpec:
    return TPLayerSpec(patterns=[pattern], partition_type=PartitionType.SKIP)


_O_PROJ = r".*\.self_attn\.o_proj\.weight$"
_QKV_PROJ = r".*\.self_attn\.[qkv]_proj\.weight$"
_DOWN_PROJ = r".*\.mlp\.down_proj\.weight$"
_GATE_UP_PROJ = r".*\.mlp\.(up|gate)_proj\.weight$"
_DENSE = r".*\.self_attention\.dense\.weight$"
_QUERY_KEY_VALUE = r".*\.self_attention\.query_key_value\.weight$"
_DENSE_4H_TO_H = r".*\.mlp\.dense_4h_to_h\.weight$"
_DENSE_H_TO_4H = r".*\.mlp\.dense_h_to_4h\.weight$"


def _separate_qkv_decoder() -> AutoTPConfig:
    """Separate q/k/v projections and a gated MLP (Llama, Qwen2 and their relatives)."""
    return AutoTPConfig(
        layer_specs=[_row(_O_PROJ), _column(_QKV_PROJ), _row(_DOWN_PROJ), _column(_GATE_UP_PROJ)]
    )


class AutoTPPresets:
    """Partition rules for model families, by name (``tensor_parallel.preset_model``)."""

    @staticmethod
    def llama() -> AutoTPConfig:
        """Llama: separate q/k/v projections, gated MLP."""
        return _separate_qkv_decoder()

    @staticmethod
    def llama_gqa(num_heads: int, num_kv_heads: int, head_dim: int) -> AutoTPConfig:
        """Llama-style with one fused ``qkv_proj`` whose K and V are narrower than Q (GQA)."""
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        return AutoTPConfig(
            layer_specs=[
                _row(_O_PROJ),
                _column(
                    r".*\.self_attn\.qkv_proj\.weight$", shape=((q_size, kv_size, kv_size), -1)
                ),
                _row(_DOWN_PROJ),
                _column(_GATE_UP_PROJ),
            ]
        )

    @staticmethod
    def bloom() -> AutoTPConfig:
        """BLOOM: a fused QKV with q, k, v interleaved per head, so a plain output split keeps heads whole."""
        return AutoTPConfig(
            layer_specs=[
                _row(_DENSE),
                _column(_QUERY_KEY_VALUE),
                _row(_DENSE_4H_TO_H),
                _column(_DENSE_H_TO_4H),
            ]
        )

    @staticmethod
    def chatglm() -> AutoTPConfig:
        """ChatGLM: a fused QKV laid out [Q; K; V] and a packed [gate; up] MLP input."""
        return AutoTPConfig(
            layer_specs=[
                _row(_DENSE),
                _column(_QUERY_KEY_VALUE, shape=(3, -1)),
                _row(_DENSE_4H_TO_H),
                _column(_DENSE_H_TO_4H, shape=(2, -1)),
            ]
        )

    @staticmethod
    def mixtral() -> AutoTPConfig:
        """Mixtral: Llama attention, per-expert w1/w3 (column) and w2 (row), the router whole."""
        experts = r".*\.block_sparse_moe\.experts\.\d+"
        return AutoTPConfig(
            layer_specs=[
                _row(_O_PROJ),
                _column(_QKV_PROJ),
                _row(experts + r"\.w2\.weight$"),
                _column(experts + r"\.w[13]\.weight$"),
                _skip(r".*\.block_sparse_moe\.gate\.weight$"),
            ]
        )

    @staticmethod
    def deepseek_v2() -> AutoTPConfig:
        """DeepSeek-V2: MLA's low-rank down projections whole, its up projections and the experts
        (routed and shared) split, the router whole."""
        return AutoTPConfig(
            layer_specs=[
                _row(_O_PROJ),
                _skip(r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"),
                _column(r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"),
                _row(r".*\.mlp\.experts\.\d+\.down_proj\.weight$"),
                _column(r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"),
                _skip(r".*\.mlp\.gate\.weight$"),
                _row(r".*\.mlp\.shared_experts\.down_proj\.weight$"),
                _column(r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$"),
            ]
        )

    @staticmethod
    def qwen2() -> AutoTPConfig:
        """Qwen2: the Llama layout (the specs name weights; a q/k/v bias goes with its layer)."""
        return _separate_qkv_decoder()

    @staticmethod
    def phi3() -> AutoTPConfig:
        """Phi-3: a fused ``qkv_proj`` laid out [Q; K; V] and a packed ``gate_up_proj``."""
        return AutoTPConfig(
            layer_specs=[
                _row(_O_PROJ),
                _column(r".*\.self_attn\.qkv_proj\.weight$", shape=(3, -1)),
                _row(_DOWN_PROJ),
                _column(r".*\.mlp\.gate_up_proj\.weight$", shape=(2, -1)),
            ]
        )

    @staticmethod
    def get_preset(model_type: str) -> AutoTPConfig | None:
        """A fresh copy of the preset named ``model_type`` (any case); None when there is none."""
        builder = _PRESETS.get(str(model_type).lower())
        return None if builder is None else builder()


_PRESETS: dict[str, Callable[[], AutoTPConfig]] = {
    "llama": AutoTPPresets.llama,
    "bloom": AutoTPPresets.bloom,
    "chatglm": AutoTPPresets.chatglm,
    "mixtral": AutoTPPresets.mixtral,
    "deepseek_v2": AutoTPPresets.deepseek_v2,
    "qwen2": AutoTPPresets.qwen2,
    "phi3": AutoTPPresets.phi3,
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
"""The names ``tensor_parallel.preset_model`` accepts."""


def resolve_autotp_config(
    partition_config: Mapping[str, Any] | None,
    preset_model: str | None,
    model_type: str | None,
) -> AutoTPConfig | None:
    """The partition rules the config asks for, or None when it asks for none.

    ``partition_config``'s specs come first; when its ``use_default_specs`` is true (the
    default) the preset follows them: ``preset_model``'s, else the one named like the model's
    ``model_type``, if any. ``preset_model`` alone gives that preset. With neither, the result
    is None and the caller falls back to the model's Hugging Face ``tp_plan``, then to the
    structural rules. An empty ``partition_config`` counts as absent, as in DeepSpeed.
    """
    preset: AutoTPConfig | None = None
    if preset_model is not None:
        preset = AutoTPPresets.get_preset(preset_model)
        if preset is None:
            raise DeepSpeedConfigError(
                f"tensor_parallel.preset_model {preset_model!r} is not a preset; choose one of "
                f"{', '.join(PRESET_NAMES)} (any case), or describe the model with "
                "tensor_parallel.partition_config.layer_specs"
            )
    if not partition_config:
        return preset
    custom = AutoTPConfig.from_dict(partition_config)
    if not custom.use_default_specs:
        return custom
    if preset is None and model_type is not None:
        preset = AutoTPPresets.get_preset(model_type)
    return custom if preset is None else merge_autotp_configs(preset, custom)
