"""Top-1, top-2 and top-k gating in DeepSpeed's semantics, producing index-based ``Routing``.

Decisions are made on ``tokens x experts`` masks (as in GShard/DeepSpeed); nothing here builds
the ``tokens x experts x capacity`` tensors. Capacity is ``ceil(tokens / experts * factor)``
floored at ``min_capacity`` (the factor is multiplied by k for top-2/top-k); with
``drop_tokens=False`` it is the largest expert load instead, so no token is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from shardspeed import comm
from shardspeed.moe.noise import gumbel_rsample
from shardspeed.moe.routing import Routing

DROP_POLICIES = ("probs", "position")


class TooFewTokensError(ValueError, AssertionError):
    """Fewer tokens than ``min_capacity`` (DeepSpeed asserts; callers may catch either)."""


def capacity_for(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int
) -> int:
    """``ceil(num_tokens / num_experts * capacity_factor)``, at least ``min_capacity``."""
    # float32 arithmetic, as DeepSpeed computes it, so boundary cases round the same way
    raw = torch.ceil(torch.tensor(num_tokens / num_experts) * torch.tensor(capacity_factor))
    return max(int(raw.item()), min_capacity)


def _largest_load(exp_counts: Tensor, ep_group: comm.ProcessGroup | None) -> int:
    """Capacity without dropping: the busiest expert's load, the maximum over the EP group."""
    load = exp_counts.max().detach().clone()
    if ep_group is not None and comm.get_world_size(group=ep_group) > 1:
        comm.all_reduce(load, op=comm.ReduceOp.MAX, group=ep_group)
    return int(load.item())


def _balance_loss(gates: Tensor, first_choice: Tensor) -> Tensor:
    """Mean over experts of (mean gate prob) x (fraction of tokens routed first to it)."""
    return torch.mean(gates.mean(dim=0) * first_choice.float().mean(dim=0))


def route_top1(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: comm.ProcessGroup | None = None,
) -> Routing:
    """Switch-style top-1 routing.

    ``RSample`` picks the expert from logits plus Gumbel noise. ``used_token`` (0/1 per token)
    multiplies the routing mask, removing tokens from routing. Over capacity each expert keeps
    the tokens ``torch.topk`` picks along the token axis of the mask, as DeepSpeed does: with
    ``use_rts`` the mask times uniform noise (a random subset), without it the 0/1 mask itself,
    where the kept tokens are the ones topk returns among equal scores (not the earliest).
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if noisy_gate_policy == "RSample":
        choice = torch.argmax(logits + gumbel_rsample(logits.shape, device=logits.device), dim=1)
    else:
        choice = torch.argmax(gates, dim=1)
    mask = F.one_hot(choice, num_classes=num_experts)
    if used_token is not None:
        # a product, not a boolean select: the mask takes used_token's dtype as DeepSpeed's
        # einsum gives it, and topk's choice among equal scores can depend on the dtype
        mask = used_token.reshape(-1, 1) * mask
    exp_counts = mask.sum(dim=0).detach()

    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(_largest_load(exp_counts, ep_group), num_tokens)
    l_aux = _balance_loss(gates, mask) * num_experts * num_experts
    if num_tokens < min_capacity:
        raise TooFewTokensError(
            f"top-1 gating got {num_tokens} tokens, fewer than min_capacity={min_capacity}: "
            "set min_capacity to 0 or increase the batch size"
        )

    # the same topk call on the same scores as DeepSpeed: which tokens survive an overflow
    # decides the loss curve, and topk's order among ties is its own (neither earliest nor
    # stable), so anything but this exact selection drifts from DeepSpeed's curves
    scores = mask * torch.rand(mask.shape, device=logits.device) if use_rts else mask
    chosen = torch.topk(scores, k=min(capacity, num_tokens), dim=0).indices
    mask = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)

    kept = mask != 0
    locations = ((torch.cumsum(kept.long(), dim=0) - 1) * kept).sum(dim=1)
    weights = (gates * mask.to(gates.dtype)).sum(dim=1)
    return Routing(
        l_aux=l_aux,
        exp_counts=exp_counts,
        capacity=capacity,
        num_experts=num_experts,
        experts=choice.unsqueeze(1),
        locations=locations.unsqueeze(1),
        weights=weights.unsqueeze(1),
        kept=kept.any(dim=1).unsqueeze(1),
    )


def route_top2(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    top2_2nd_expert_sampling: bool = True,
) -> Routing:
    """GShard top-2 routing; the second expert is sampled (Gumbel-max) when asked.

    First choices take buffer rows before second choices; slots past capacity are dropped and
    the surviving gate values of a token are renormalised to sum to 1.
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    second_logits = logits
    if top2_2nd_expert_sampling:
        second_logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    second = torch.argmax(second_logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = _balance_loss(gates, mask1) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()

    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < capacity).to(mask1.dtype)
        mask2 = mask2 * (locations2 < capacity).to(mask2.dtype)
    else:
        capacity = _largest_load(exp_counts, ep_group)

    gate1 = (gates * mask1.to(gates.dtype)).sum(dim=1)
    gate2 = (gates * mask2.to(gates.dtype)).sum(dim=1)
    denom = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    return Routing(
        l_aux=l_aux,
        exp_counts=exp_counts,
        capacity=capacity,
        num_experts=num_experts,
        experts=torch.stack([first, second], dim=1),
        locations=torch.stack([(locations1 * mask1).sum(1), (locations2 * mask2).sum(1)], dim=1),
        weights=torch.stack([gate1 / denom, gate2 / denom], dim=1),
        kept=torch.stack([mask1.sum(1) > 0, mask2.sum(1) > 0], dim=1),
    )


def route_topk(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    drop_policy: str = "probs",
) -> Routing:
    """Top-k routing. Over capacity, ``drop_policy="probs"`` keeps each expert's tokens with the
    highest gate values, ``"position"`` keeps the earliest. Kept gates are renormalised."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"Invalid drop_policy: {drop_policy!r}; expected one of {DROP_POLICIES}")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = _balance_loss(gates, mask) * num_experts * num_experts / k

    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            routed_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            chosen = torch.topk(
                routed_gates, k=min(capacity, num_tokens), dim=0, sorted=False
            ).indices
            mask &= torch.zeros_like(mask).scatter_(0, chosen, True)
        else:
            mask &= torch.cumsum(mask, dim=0) - 1 < capacity
    else:
        capacity = _largest_load(exp_counts, ep_group)

    locations = torch.cumsum(mask, dim=0) - 1
    masked_gates = gates * mask
    masked_gates = masked_gates / torch.clamp(
        masked_gates.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps
    )
    kept = mask.gather(1, top_idx)
    return Routing(
        l_aux=l_aux,
        exp_counts=exp_counts,
        capacity=capacity,
        num_experts=num_experts,
        experts=top_idx,
        locations=locations.gather(1, top_idx) * kept,
        weights=masked_gates.gather(1, top_idx),
        kept=kept,
    )
