"""``expert_parallel``: automatic expert parallelism (AutoEP) for HF MoE models."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = ["ExpertParallelConfig"]


class ExpertParallelConfig(DeepSpeedConfigModel):
    """``expert_parallel``: AutoEP degree, model preset and custom-model overrides."""

    json_key: ClassVar[str] = "expert_parallel"

    enabled: bool = False
    """Replace detected MoE blocks with expert-parallel layers."""
    autoep_size: int = Field(default=1, gt=0)
    """Expert-parallel degree; must divide every layer's expert count."""
    preset_model: str | None = None
    """mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2 or deepseek_v3."""
    load_balance_coeff: float | None = None
    """Must be null (expert-bias balancing is not supported)."""
    moe_layer_pattern: str | None = None
    """Regex of MoE block names (custom models)."""
    expert_pattern: str | None = None
    """Regex of expert container names."""
    router_pattern: str | None = None
    """Regex of router names."""
    use_grouped_mm: bool = True
    """Use grouped GEMM for the experts."""
    route_norm: bool | None = None
    """Normalize the top-k routing weights."""
    route_scale: float = 1.0
    """Scale of the routing weights."""
    score_apply: str = "auto"
    """Where routing scores are applied, or ``"auto"``."""
    combine_impl: str = "auto"
    """How expert outputs are combined, or ``"auto"``."""
    num_expert_groups: int | None = None
    """Expert groups for group-limited routing."""
    num_limited_groups: int | None = None
    """Groups each token may use."""
    score_func: str = "auto"
    """Router score function, or ``"auto"``."""
    top_k: int | str = "auto"
    """Experts per token, or ``"auto"``."""
    routed_scaling_factor: float | str = "auto"
    """Scale of routed outputs, or ``"auto"``."""
    expert_w1: str | None = None
    """Name of the experts' first projection."""
    expert_w2: str | None = None
    """Name of the experts' second projection."""
    num_experts_attr: str | None = None
    """Model-config attribute holding the expert count."""
    top_k_attr: str | None = None
    """Model-config attribute holding top-k."""
    has_shared_experts: bool | None = None
    """Whether blocks have shared experts."""
    shared_experts_pattern: str | None = None
    """Regex of shared-expert names."""
    shared_experts_gate_pattern: str | None = None
    """Regex of shared-expert gate names."""

    @field_validator("top_k", "routed_scaling_factor")
    @classmethod
    def _number_or_auto(cls, value: int | float | str) -> int | float | str:
        if isinstance(value, str) and value != "auto":
            raise ValueError(f'expected a number or "auto", got {value!r}')
        return value
