"""``Experts``: the local copies of the expert module, marked as expert parameters."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` under ``deepspeed_experts.<i>``.

    Every expert parameter gets ``allreduce = False`` and ``group_name = expert_group_name``:
    the marks DeepSpeed uses to reduce expert gradients over the expert-data-parallel group only.
    """

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
                param.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs`` is ``[groups, num_local_experts, capacity, model_dim]``; expert i gets slice i."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts, strict=True):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]  # experts such as Megatron's MLP also return a bias
            outputs.append(out)
        return torch.cat(outputs, dim=1)
