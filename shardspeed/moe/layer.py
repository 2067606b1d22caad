"""``MoE``: DeepSpeed's user-facing Mixture-of-Experts layer (``deepspeed.moe.layer.MoE``)."""

from __future__ import annotations

from torch import Tensor, nn

from shardspeed.moe.experts import Experts
from shardspeed.moe.sharded_moe import TUTEL_REFUSED, MOELayer, TopKGate
from shardspeed.utils import groups

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class MoE(nn.Module):
    """A Mixture-of-Experts layer: ``forward`` returns ``(output, l_aux, exp_counts)``.

    ``k`` experts per token out of ``num_experts``; ``use_residual`` adds the dense ``expert``
    as a residual branch mixed by a learned 2-way coefficient (Residual MoE, arXiv 2201.05596).
    Expert weights live at ``deepspeed_moe.experts.deepspeed_experts.<i>.*`` and the router at
    ``deepspeed_moe.gate.wg.weight``, as in DeepSpeed. With ``ep_size > 1`` this rank holds
    ``num_experts / ep_size`` of them (``deepspeed_experts.<i>`` is global expert
    ``ep_rank * num_local_experts + i``) and tokens reach them by all-to-all over the
    expert-parallel group, which :func:`shardspeed.initialize` makes (or
    :meth:`set_deepspeed_parallelism`).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError(TUTEL_REFUSED)
        if ep_size < 1 or num_experts % ep_size != 0:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})"
            )
        if enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "enable_expert_tensor_parallelism=True is not supported by shardspeed (it has no "
                "tensor parallelism for training); pass enable_expert_tensor_parallelism=False"
            )
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r} is not one of {NOISY_GATE_POLICIES}"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = groups.expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Make this layer's expert-parallel groups (if no layer of the same ``ep_size`` made
        them) and route over them. Every rank calls it, for its layers in the same order."""
        self._create_process_groups(use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        groups._create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        if used_token is None:
            output = self.deepspeed_moe(hidden_states)
        else:
            output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = nn.functional.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
