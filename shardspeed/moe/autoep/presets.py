"""AutoEP presets: where a Hugging Face model family keeps its MoE blocks, routers and experts.

Every supported family stores its routed experts the Transformers 5 way: one ``Experts`` module
with fused 3-D weights, ``gate_up_proj`` ``[E, 2 * ffn, hidden]`` (gate rows first, then up) and
``down_proj`` ``[E, hidden, ffn]``, next to a top-k router that returns
``(router_logits, routing_weights, expert_indices)``. Shared experts (Qwen2-MoE, Qwen3.5-MoE,
DeepSeek) stay ordinary replicated modules.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoEPreset", "PRESETS", "preset_for_model_type"]

#: every decoder layer's feed-forward, also inside a multimodal wrapper (``model.language_model``)
_LAYER_MLP = r"(?:.*\.)?layers\.\d+\.mlp"


@dataclass(frozen=True)
class MoEPreset:
    """Names and routing defaults of one model family's MoE blocks."""

    name: str
    model_types: tuple[str, ...]
    """``model.config.model_type`` values this preset covers."""
    moe_layer_pattern: str = _LAYER_MLP
    """Regex (full match) of the MoE block's qualified name."""
    router_name: str = "gate"
    experts_name: str = "experts"
    expert_w1: str = "gate_up_proj"
    expert_w2: str = "down_proj"
    num_experts_attr: str = "num_experts"
    top_k_attr: str = "num_experts_per_tok"
    score_func: str = "softmax"
    """Router score function for a plain ``nn.Linear`` router (softmax or sigmoid)."""
    route_norm: bool = True
    """Renormalise the top-k weights (plain ``nn.Linear`` routers)."""
    shared_experts_name: str | None = None
    shared_experts_gate_name: str | None = None
    supports_load_balance_coeff: bool = True


PRESETS: dict[str, MoEPreset] = {
    "mixtral": MoEPreset("mixtral", ("mixtral",), num_experts_attr="num_local_experts"),
    # Qwen2-MoE has the same fused layout plus a gated shared expert
    "qwen3_moe": MoEPreset(
        "qwen3_moe",
        ("qwen3_moe", "qwen2_moe"),
        shared_experts_name="shared_expert",
        shared_experts_gate_name="shared_expert_gate",
    ),
    "qwen3_5_moe": MoEPreset(
        "qwen3_5_moe",
        ("qwen3_5_moe_text", "qwen3_5_moe"),
        shared_experts_name="shared_expert",
        shared_experts_gate_name="shared_expert_gate",
    ),
    "deepseek_v2": MoEPreset(
        "deepseek_v2",
        ("deepseek_v2",),
        num_experts_attr="n_routed_experts",
        route_norm=False,
        shared_experts_name="shared_experts",
        supports_load_balance_coeff=False,
    ),
    "deepseek_v3": MoEPreset(
        "deepseek_v3",
        ("deepseek_v3",),
        num_experts_attr="n_routed_experts",
        score_func="sigmoid",
        shared_experts_name="shared_experts",
        supports_load_balance_coeff=False,
    ),
}


def preset_for_model_type(model_type: str | None) -> MoEPreset | None:
    """The preset whose family has ``model_type``, if any."""
    for preset in PRESETS.values():
        if model_type in preset.model_types:
            return preset
    return None
