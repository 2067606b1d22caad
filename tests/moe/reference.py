"""A plain, loop-by-loop dense reference of DeepSpeed's gating, for the parity tests.

It builds the ``tokens x experts x capacity`` combine weights one token at a time, with no
randomness (``use_rts=False``, no noisy gate, no second-expert sampling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DenseGate:
    l_aux: float
    combine: Tensor  # [S, E, C]
    exp_counts: list[int]
    capacity: int


def _choices(gates: Tensor, logits: Tensor, k: int, second_from_logits: bool) -> list[list[int]]:
    """Experts per token, best first (top-2 takes its second pick from the logits)."""
    rows: list[list[int]] = []
    for s in range(gates.shape[0]):
        if second_from_logits:
            first = int(gates[s].argmax())
            rest = logits[s].clone()
            rest[first] = float("-inf")
            rows.append([first, int(rest.argmax())])
        else:
            rows.append([int(i) for i in torch.topk(gates[s], k).indices])
    return rows


def reference_gating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool,
    used_token: Tensor | None = None,
    drop_policy: str = "probs",
    kind: str = "",
) -> DenseGate:
    """``kind`` is top1, top2 (DeepSpeed's dedicated functions) or topk; default by ``k``."""
    kind = kind or {1: "top1", 2: "top2"}.get(k, "topk")
    gates = torch.softmax(logits.double(), dim=1)
    num_tokens, num_experts = gates.shape
    used = [True] * num_tokens if used_token is None else [bool(u) for u in used_token]
    choices = _choices(gates, logits, k, second_from_logits=kind == "top2")

    counts = [0] * num_experts
    for s in range(num_tokens):
        if used[s]:
            for e in choices[s]:
                counts[e] += 1
    if drop_tokens:
        factor = capacity_factor * k
        capacity = max(math.ceil(num_tokens / num_experts * factor), min_capacity)
    else:
        capacity = min(max(counts), num_tokens) if kind == "top1" else max(counts)

    # auxiliary loss: mean gate prob x fraction routed (first choice for k <= 2, any for top-k)
    me = gates.mean(dim=0)
    ce = [0.0] * num_experts
    for s in range(num_tokens):
        if used[s]:
            for e in choices[s] if kind == "topk" else choices[s][:1]:
                ce[e] += 1.0 / num_tokens
    dot = sum(float(me[e]) * ce[e] for e in range(num_experts))
    l_aux = dot * num_experts / (k if kind == "topk" else 1)

    # keep decisions and buffer locations, slot (token, j) -> location or None
    location: dict[tuple[int, int], int] = {}
    if kind == "top1" and drop_tokens:
        # DeepSpeed's top-1 rule: each expert keeps the tokens torch.topk returns over the
        # token axis of the 0/1 routing mask (its order among equal ones, not the earliest)
        mask = torch.zeros(num_tokens, num_experts, dtype=torch.long)
        for s in range(num_tokens):
            if used[s]:
                mask[s, choices[s][0]] = 1
        picked = torch.topk(mask, min(capacity, num_tokens), dim=0).indices
        fill = [0] * num_experts
        for s in range(num_tokens):
            e = choices[s][0]
            if used[s] and s in picked[:, e].tolist():
                location[(s, 0)] = fill[e]
                fill[e] += 1
    elif kind != "topk":
        fill = [0] * num_experts
        for j in range(k):  # all first choices are placed before any second choice
            for s in range(num_tokens):
                if not used[s]:
                    continue
                e = choices[s][j]
                if fill[e] < capacity or not drop_tokens:
                    location[(s, j)] = fill[e]
                fill[e] += 1
    else:
        kept: set[tuple[int, int]] = set()
        for e in range(num_experts):
            routed = [(s, choices[s].index(e)) for s in range(num_tokens) if e in choices[s]]
            if drop_tokens and drop_policy == "probs":
                routed = sorted(routed, key=lambda sj: -float(gates[sj[0], e]))[:capacity]
            elif drop_tokens:
                routed = routed[:capacity]
            kept.update(routed)
        fill = [0] * num_experts
        for s in range(num_tokens):
            for j, e in enumerate(choices[s]):
                if (s, j) in kept:
                    location[(s, j)] = fill[e]
                    fill[e] += 1

    combine = torch.zeros(num_tokens, num_experts, capacity, dtype=torch.float64)
    for s in range(num_tokens):
        slots = [j for j in range(k) if (s, j) in location]
        total = sum(float(gates[s, choices[s][j]]) for j in slots)
        for j in slots:
            e = choices[s][j]
            weight = float(gates[s, e])
            if kind != "top1":
                weight /= max(total, torch.finfo(torch.float32).eps)
            combine[s, e, location[(s, j)]] = weight
    return DenseGate(l_aux=l_aux, combine=combine, exp_counts=counts, capacity=capacity)
