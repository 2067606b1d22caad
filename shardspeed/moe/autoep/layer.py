"""``AutoEPMoELayer``: a Hugging Face MoE block with its routed experts split over the
expert-parallel group.

Forward, for the tokens of this rank: route (the block's own router, kept as it is, so its
logits are still recorded for Transformers' ``output_router_logits`` aux loss); copy every token
once per chosen expert and sort the copies by expert; send each rank the copies for its experts
(counts exchanged first, so no token is dropped and no buffer is padded); run the local experts;
send the results back; weight them and add them up per token. Shared experts run locally.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from shardspeed.moe.autoep.detection import MoEBlockSpec
from shardspeed.moe.autoep.exchange import exchange_counts, uneven_all_to_all
from shardspeed.moe.autoep.experts import LocalExperts
from shardspeed.moe.autoep.routing import RoutingRule
from shardspeed.runtime.zero.partition_parameters import GatheredParameters


def _expert_major(counts: Tensor) -> Tensor:
    """Rows arrive grouped by (source rank, local expert); the index that regroups them by
    (local expert, source rank), so each local expert's rows are contiguous."""
    sizes = counts.reshape(-1).tolist()
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    sources, local = counts.shape
    pieces = [
        torch.arange(starts[s * local + e], starts[s * local + e] + sizes[s * local + e])
        for e in range(local)
        for s in range(sources)
    ]
    return torch.cat(pieces).to(counts.device)


class AutoEPMoELayer(nn.Module):
    """A detected MoE block holding ``num_experts / ep_size`` of its experts.

    The router, the shared experts and their gate keep their names (and stay replicated); the
    experts module is replaced by :class:`LocalExperts` under its name, so state-dict keys keep
    their shape of names, each rank's expert tensors holding its slice.
    """

    def __init__(
        self,
        spec: MoEBlockSpec,
        *,
        ep_size: int,
        ep_rank: int,
        ep_group: Any,
        group_name: str,
        w1_name: str,
        w2_name: str,
        routing: RoutingRule | None = None,
        use_grouped_mm: bool = True,
    ) -> None:
        super().__init__()
        block = spec.block
        self.num_experts = spec.num_experts
        self.top_k = spec.top_k
        self.ep_size = ep_size
        self.ep_group = ep_group
        self.num_local_experts = spec.num_experts // ep_size
        self.routing = routing
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.router_name, self.experts_name = spec.router_name, spec.experts_name
        self.shared_name, self.shared_gate_name = (
            spec.shared_experts_name,
            spec.shared_experts_gate_name,
        )
        self.add_module(self.router_name, getattr(block, self.router_name))
        for name in (self.shared_name, self.shared_gate_name):
            if name is not None:
                self.add_module(name, getattr(block, name))
        fused = getattr(block, self.experts_name)
        first = ep_rank * self.num_local_experts
        local = slice(first, first + self.num_local_experts)
        w1, w2 = getattr(fused, w1_name), getattr(fused, w2_name)
        # a model partitioned by zero.Init: its fused tensors whole while their slice is copied
        with GatheredParameters([w1, w2]):
            experts = LocalExperts(
                w1[local],
                w2[local],
                fused.act_fn,
                first=first,
                group_name=group_name,
                w1_name=w1_name,
                w2_name=w2_name,
                use_grouped_mm=use_grouped_mm,
            )
        self.add_module(self.experts_name, experts)

    @property
    def local_experts(self) -> LocalExperts:
        experts = getattr(self, self.experts_name)
        assert isinstance(experts, LocalExperts)
        return experts

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """The block's output (and, for a plain linear router, its logits as older blocks did)."""
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
            hidden_states = hidden_states * noise
        flat = hidden_states.reshape(-1, shape[-1])
        logits, weights, indices = self._route(flat)
        out = self._routed(flat, weights, indices)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(flat)
            if self.shared_gate_name is not None:
                shared = torch.sigmoid(getattr(self, self.shared_gate_name)(flat)) * shared
            out = out + shared
        out = out.reshape(shape)
        return out if self.routing is None else (out, logits)

    def _route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        router = getattr(self, self.router_name)
        if self.routing is not None:
            logits = router(flat)
            weights, indices = self.routing.route(logits)
            return logits, weights, indices
        routed = router(flat)
        if not (isinstance(routed, tuple) and len(routed) == 3):
            raise TypeError(
                f"AutoEP: the router {type(router).__name__} returned {type(routed).__name__}; "
                "expected (router_logits, routing_weights, expert_indices) as Transformers 5 "
                "routers return, or an nn.Linear router"
            )
        return routed

    def _routed(self, flat: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        top_k = indices.shape[-1]
        chosen = indices.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        token_of = order // top_k
        rows = flat[token_of]
        row_weights = weights.reshape(-1)[order].unsqueeze(-1)
        pre = self.routing is not None and self.routing.score_apply == "pre"
        if pre:
            rows = rows * row_weights.to(rows.dtype)
        counts = torch.bincount(chosen, minlength=self.num_experts)
        if self.ep_size == 1:
            out_rows = self.local_experts(rows, counts.tolist())
        else:
            out_rows = self._exchange_and_run(rows, counts)
        if not pre:
            out_rows = out_rows * row_weights
        combined = torch.zeros_like(flat)
        return combined.index_add(0, token_of, out_rows.to(flat.dtype))

    def _exchange_and_run(self, rows: Tensor, counts: Tensor) -> Tensor:
        received = exchange_counts(self.ep_group, counts, self.ep_size)
        send = counts.view(self.ep_size, -1).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        arrived = uneven_all_to_all(self.ep_group, rows, send, recv)
        regroup = _expert_major(received)
        computed = self.local_experts(arrived[regroup], received.sum(dim=0).tolist())
        back = computed[torch.argsort(regroup)]
        return uneven_all_to_all(self.ep_group, back, recv, send)
