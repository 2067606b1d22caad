"""Top-k routing for MoE blocks whose router is a plain ``nn.Linear`` (custom or older models).

Transformers 5 routers (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter``,
...) route themselves and are called as they are; this rule is only for a router that returns
logits, configured by the ``expert_parallel`` keys ``score_func``, ``top_k``, ``route_norm``,
``route_scale``/``routed_scaling_factor``, ``score_apply`` and the group-limited pair
``num_expert_groups``/``num_limited_groups``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RoutingRule:
    """How router logits become ``(weights, expert_indices)``, each ``[tokens, top_k]``."""

    top_k: int
    score_func: str = "softmax"
    route_norm: bool = True
    scale: float = 1.0
    score_apply: str = "post"
    """``post``: weight the experts' outputs; ``pre``: weight their inputs."""
    num_groups: int | None = None
    limited_groups: int | None = None

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Weights (in ``logits``' dtype) and indices of each token's ``top_k`` experts."""
        if self.score_func == "sigmoid":
            scores = logits.float().sigmoid()
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        choice = scores
        if self.num_groups and self.limited_groups:
            choice = self._limit_groups(scores)
        indices = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(logits.dtype), indices

    def _limit_groups(self, scores: Tensor) -> Tensor:
        """Keep only each token's ``limited_groups`` best expert groups (by their best score)."""
        assert self.num_groups is not None and self.limited_groups is not None
        tokens, experts = scores.shape
        grouped = scores.view(tokens, self.num_groups, experts // self.num_groups)
        best = torch.topk(grouped.amax(dim=-1), self.limited_groups, dim=-1).indices
        keep = torch.zeros(tokens, self.num_groups, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        return scores.masked_fill(~keep, float("-inf"))
