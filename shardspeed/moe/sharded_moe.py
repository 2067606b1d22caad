"""DeepSpeed's ``deepspeed.moe.sharded_moe``: the gating functions, ``TopKGate`` and ``MOELayer``.

The gating functions keep DeepSpeed's signatures and return its dense
``(l_aux, combine_weights, dispatch_mask, exp_counts)``; ``MOELayer`` itself routes through the
index-based ``Routing`` (see ``gating.py`` and ``dispatch.py``) and never builds the dense tensors.
With ``ep_size > 1`` each rank holds ``num_experts / ep_size`` experts and the expert buffers
travel by all-to-all over the expert-parallel group (``all_to_all.py``).

With ``sparse_routes=True`` the gating functions return DeepSpeed's per-route form instead, and
``_route_slots`` / ``_sparse_encode`` / ``_sparse_decode`` (DeepSpeed's names) dispatch and
combine with it; they run on the same slot kernels as ``MOELayer`` (``dispatch.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from shardspeed import comm
from shardspeed import comm as dist  # noqa: F401 - DeepSpeed's name; its tests patch dist.*
from shardspeed.moe.all_to_all import (
    _AllToAll,  # noqa: F401 - DeepSpeed's import path
    agree_capacity,
    all_to_all,
)
from shardspeed.moe.dispatch import combine, decode, dispatch, encode
from shardspeed.moe.gating import route_top1, route_top2, route_topk
from shardspeed.moe.noise import gumbel_rsample, multiplicative_jitter
from shardspeed.moe.routing import Routing, route_slots
from shardspeed.runtime.zero.partition_parameters import register_external_parameter

__all__ = [
    "MOELayer",
    "TopKGate",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]

NO_EP_GROUP = (
    "this MoE layer has ep_size={ep_size} but no expert-parallel group yet: pass the model to "
    "deepspeed.initialize (which makes the groups), or call set_deepspeed_parallelism() on the "
    "MoE layer after torch.distributed is initialized"
)
TUTEL_REFUSED = "use_tutel=True is not supported by shardspeed (Tutel kernels are not used); pass use_tutel=False"
#: DeepSpeed's switches, for code that reads them: einsum is always torch.einsum; no Tutel
USE_EINSUM = True
TUTEL_INSTALLED = False


def einsum(rule: str, a: Tensor, b: Tensor) -> Tensor:
    """``torch.einsum(rule, a, b)`` (DeepSpeed's helper, used by code built on its gates)."""
    return torch.einsum(rule, a, b)


def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """Expert capacity for ``[tokens, experts]`` gates: ``ceil(tokens / experts * factor)``,
    at least ``min_capacity``, as an int64 tensor."""
    num_tokens, num_experts = gates.shape
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    return torch.maximum(capacity, min_capacity.to(torch.int64))


def _top_idx(source: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries of each column of ``source`` (along tokens)."""
    return torch.topk(source, k=k, dim=0)[1]


def _one_hot_to_float(x: Tensor, num_classes: int) -> Tensor:
    return torch.nn.functional.one_hot(x, num_classes=num_classes).float()


#: what the gating functions return: DeepSpeed's dense 4-tuple, or with ``sparse_routes=True``
#: ``(l_aux, capacity, num_experts, indices_, locations_, gates_, exp_counts)``
GateOutput = tuple[Any, ...]


def _gate_output(routing: Routing, sparse_routes: bool) -> GateOutput:
    return routing.as_sparse_routes() if sparse_routes else routing.as_deepspeed_tuple()


def _route_major(routes: Tensor | Sequence[Tensor], name: str) -> Tensor:
    """DeepSpeed's per-route list (one ``[S]`` tensor per route rank) as one ``[k, S]`` tensor."""
    if isinstance(routes, Tensor):
        if routes.dim() == 1:
            return routes.unsqueeze(0)
        if routes.dim() == 2:
            return routes
        raise ValueError(f"{name} must be [S] or [k, S] tensors, got {tuple(routes.shape)}")
    if len(routes) == 0:
        raise ValueError(f"{name} is empty: pass one [S] tensor per route (k >= 1)")
    return torch.stack(list(routes), dim=0)


def _route_slots(
    indices_: Tensor | Sequence[Tensor],
    locations_: Tensor | Sequence[Tensor],
    num_experts: int,
    capacity: int | Tensor,
) -> Tensor:
    """Buffer slot of every route of a ``sparse_routes=True`` gate output.

    ``indices_``/``locations_`` are the gate's per-route lists (or ``[k, S]`` tensors). Returns
    ``[k, S]`` int64 slots ``index * capacity + location``, ``-1`` for a dropped route
    (index -1) or one outside the ``num_experts x capacity`` buffer.
    """
    experts = _route_major(indices_, "indices_")
    locations = _route_major(locations_, "locations_")
    return route_slots(experts, locations, int(num_experts), int(capacity))


def _sparse_encode(
    reshaped_input: Tensor, slots: Tensor, num_experts: int, capacity: int | Tensor
) -> Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` expert buffers by slot (``_route_slots``): equal to
    ``einsum("sec,sm->ecm", dispatch_mask, reshaped_input)``, gradient included."""
    return encode(reshaped_input, _route_major(slots, "slots"), int(num_experts), int(capacity))


def _sparse_decode(
    expert_output: Tensor,
    slots: Tensor,
    gates_: Tensor | Sequence[Tensor],
    num_tokens: int,
) -> Tensor:
    """``[E * C, M]`` expert outputs -> ``[S, M]``: each token's kept routes weighted by their
    gates and summed; equal to ``einsum("sec,ecm->sm", combine_weights, expert_output)``."""
    if expert_output.dim() != 2:
        # DeepSpeed hands over the flat [E * C, M] view; accept [E, C, M] as well
        expert_output = expert_output.reshape(-1, expert_output.shape[-1])
    return decode(
        expert_output, _route_major(slots, "slots"), _route_major(gates_, "gates_"), num_tokens
    )


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    use_tutel: bool = False,
    sparse_routes: bool = False,
) -> GateOutput:
    """Top-1 gating on ``[tokens, experts]`` logits -> ``(l_aux, combine, dispatch, exp_counts)``
    (``sparse_routes``: the per-route form, see ``Routing.as_sparse_routes``)."""
    if use_tutel:
        raise NotImplementedError(TUTEL_REFUSED)
    routing = route_top1(
        logits,
        capacity_factor,
        min_capacity,
        used_token,
        noisy_gate_policy,
        drop_tokens,
        use_rts,
        ep_group,
    )
    return _gate_output(routing, sparse_routes)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    top2_2nd_expert_sampling: bool = True,
    use_tutel: bool = False,
    sparse_routes: bool = False,
) -> GateOutput:
    """Top-2 gating on ``[tokens, experts]`` logits -> ``(l_aux, combine, dispatch, exp_counts)``
    (``sparse_routes``: the per-route form, see ``Routing.as_sparse_routes``)."""
    if use_tutel:
        raise NotImplementedError(TUTEL_REFUSED)
    routing = route_top2(
        logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling
    )
    return _gate_output(routing, sparse_routes)


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    drop_policy: str = "probs",
    use_tutel: bool = False,
    sparse_routes: bool = False,
) -> GateOutput:
    """Top-k gating on ``[tokens, experts]`` logits -> ``(l_aux, combine, dispatch, exp_counts)``
    (``sparse_routes``: the per-route form, see ``Routing.as_sparse_routes``)."""
    if use_tutel:
        raise NotImplementedError(TUTEL_REFUSED)
    routing = route_topk(
        logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy
    )
    return _gate_output(routing, sparse_routes)


class TopKGate(nn.Module):
    """The router: a bias-free ``wg`` Linear to expert logits, then top-1/top-2/top-k gating.

    Gating runs in fp32. ``capacity_factor`` applies in training, ``eval_capacity_factor`` in
    eval; the noisy policies (``Jitter`` on the input, ``RSample`` on the top-1 choice) only in
    training.
    """

    wg: nn.Linear

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: comm.ProcessGroup | None = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        # routing reads the weight without calling wg: ZeRO-3 must gather it for this module
        assert isinstance(self.wg.weight, nn.Parameter)
        register_external_parameter(self, self.wg.weight)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: comm.ProcessGroup) -> None:
        if self.ep_group is not None:
            raise RuntimeError("this gate already has an expert-parallel group")
        self.ep_group = ep_group

    def route(self, input: Tensor, used_token: Tensor | None = None) -> Routing:
        """Index-based routing of ``[tokens, model_dim]`` input."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = nn.functional.linear(x, weight=self.wg.weight.float(), bias=None)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return route_top1(
                logits,
                factor,
                self.min_capacity,
                used_token,
                policy,
                self.drop_tokens,
                self.use_rts,
                self.ep_group,
            )
        if self.k == 2:
            return route_top2(
                logits,
                factor,
                self.min_capacity,
                self.drop_tokens,
                self.ep_group,
                self.top2_2nd_expert_sampling,
            )
        return route_topk(
            logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group
        )

    def forward(
        self, input: Tensor, used_token: Tensor | None = None, use_tutel: bool = False
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """DeepSpeed's gate output ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
        if use_tutel:
            raise NotImplementedError(TUTEL_REFUSED)
        return self.route(input, used_token).as_deepspeed_tuple()


class MOELayer(nn.Module):
    """Gate, dispatch tokens to expert buffers, run the experts, combine weighted outputs.

    After ``forward``, ``l_aux`` and ``exp_counts`` hold the gate's loss and expert loads.
    """

    def __init__(
        self,
        gate: TopKGate,
        experts: nn.Module,
        ep_group_name: str | None,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError(TUTEL_REFUSED)
        self.gate = gate
        self.experts = experts
        weight = getattr(getattr(gate, "wg", None), "weight", None)
        if isinstance(weight, nn.Parameter):  # forward routes by gate.route(): gathered here
            register_external_parameter(self, weight)
        self.ep_group: comm.ProcessGroup | None = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.wall_clock_breakdown = False
        self.l_aux: Tensor = torch.zeros(())
        self.exp_counts: Tensor = torch.zeros(0, dtype=torch.long)

    def _set_ep_group(self, ep_group: comm.ProcessGroup) -> None:
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def _exchange_group(self) -> comm.ProcessGroup | None:
        """The expert-parallel group tokens travel over (None: every expert is local)."""
        if self.ep_size == 1:
            return None
        if self.ep_group is None:
            raise RuntimeError(NO_EP_GROUP.format(ep_size=self.ep_size))
        return self.ep_group

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        model_dim = hidden.shape[-1]
        tokens = hidden.reshape(-1, model_dim)
        group = self._exchange_group()
        routing = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        if group is not None:
            # one buffer size for the whole group (ranks may route different token counts)
            capacity = agree_capacity(routing.capacity, group, tokens.device)
            routing = dataclasses.replace(routing, capacity=capacity)
        buffers = dispatch(tokens, routing)
        if group is not None:
            buffers = all_to_all(group, buffers)
        buffers = buffers.reshape(self.ep_size, self.num_local_experts, -1, model_dim)
        expert_output = self.experts(buffers)
        if group is not None:
            expert_output = all_to_all(group, expert_output)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, model_dim)
        return combine(expert_output, routing).reshape(hidden.shape)
