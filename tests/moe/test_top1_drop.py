"""Top-1 dropping keeps the tokens DeepSpeed keeps when an expert overflows.

DeepSpeed's rule (``sharded_moe.top1gating``): each expert keeps the tokens that ``torch.topk``
returns along the token axis of the routing mask, the 0/1 mask itself without random token
selection, the mask times uniform noise with it. ``topk`` does not return the earliest of equal
scores, so "first come, first kept" routes other tokens and the loss curves part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardspeed.moe.gating import route_top1
from shardspeed.moe.sharded_moe import top1gating

TOKENS, EXPERTS = 20, 2


def _overflowing_logits() -> torch.Tensor:
    """Every token prefers expert 0: capacity ceil(20 / 2) = 10 keeps half of them."""
    logits = torch.zeros(TOKENS, EXPERTS)
    logits[:, 0] = 1.0
    return logits


def _kept_by_expert(routing_kept: torch.Tensor, experts: torch.Tensor) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in range(EXPERTS)]
    for token in range(TOKENS):
        if bool(routing_kept[token, 0]):
            out[int(experts[token, 0])].add(token)
    return out


def _deepspeed_rule(scores: torch.Tensor, mask: torch.Tensor, capacity: int) -> list[set[int]]:
    """The tokens each expert keeps: topk over ``scores`` along tokens, among its routed ones."""
    picked = torch.topk(scores, k=min(capacity, TOKENS), dim=0).indices
    return [{int(t) for t in picked[:, e] if bool(mask[int(t), e])} for e in range(mask.shape[1])]


def test_without_rts_the_kept_tokens_are_topks_not_the_earliest() -> None:
    logits = _overflowing_logits()
    routing = route_top1(logits, 1.0, 0, use_rts=False)
    assert routing.capacity == 10
    mask = F.one_hot(torch.argmax(F.softmax(logits, dim=1), dim=1), EXPERTS)
    expected = _deepspeed_rule(mask, mask, routing.capacity)
    kept = _kept_by_expert(routing.kept, routing.experts)
    assert kept == expected
    assert len(kept[0]) == 10
    # the case tells the rules apart: first-come-first-kept would keep tokens 0..9
    assert kept[0] != set(range(10))
    # and the dense form DeepSpeed returns puts the kept tokens in token order in the buffer
    _, combine, dispatch, _ = top1gating(logits, 1.0, 0, use_rts=False)
    rows = dispatch[:, 0, :].nonzero().tolist()
    assert sorted(t for t, _ in rows) == sorted(expected[0])
    assert [slot for _, slot in sorted(rows)] == list(range(10))
    assert torch.equal(combine.sum(dim=(1, 2)) > 0, routing.kept[:, 0])


def test_with_rts_the_kept_tokens_are_topk_over_the_noisy_mask() -> None:
    logits = _overflowing_logits()
    mask = F.one_hot(torch.argmax(F.softmax(logits, dim=1), dim=1), EXPERTS)
    torch.manual_seed(7)
    noise = torch.rand(mask.shape)  # what the gate draws for random token selection
    torch.manual_seed(7)
    routing = route_top1(logits, 1.0, 0, use_rts=True)
    expected = _deepspeed_rule(mask * noise, mask, routing.capacity)
    assert _kept_by_expert(routing.kept, routing.experts) == expected


def test_used_token_scales_the_mask_before_the_selection() -> None:
    """Unused tokens are never kept; the choice among the used ones is topk's over the mask
    times ``used_token`` (a float mask, as DeepSpeed's einsum makes it)."""
    logits = _overflowing_logits()
    used = torch.ones(TOKENS)
    used[1::4] = 0
    routing = route_top1(logits, 0.5, 0, used_token=used, use_rts=False)
    mask = F.one_hot(torch.argmax(F.softmax(logits, dim=1), dim=1), EXPERTS)
    scaled = used.reshape(-1, 1) * mask
    expected = _deepspeed_rule(scaled, scaled, routing.capacity)
    kept = _kept_by_expert(routing.kept, routing.experts)
    assert kept == expected
    assert not kept[0] & set(range(1, TOKENS, 4))
    assert routing.exp_counts.tolist() == [15.0, 0.0]


def test_deepspeed_helper_names(monkeypatch) -> None:
    """The helpers code built on DeepSpeed's gates imports, and the patch points its tests use
    (``sharded_moe.dist.all_reduce``, ``sharded_moe._AllToAll.apply``) reach our gates."""
    from shardspeed.moe import all_to_all, sharded_moe

    gates = torch.softmax(_overflowing_logits(), dim=1)
    assert int(sharded_moe._capacity(gates, torch.tensor(1.5), torch.tensor(4))) == 15
    assert int(sharded_moe._capacity(gates, torch.tensor(0.1), torch.tensor(4))) == 4
    mask = F.one_hot(torch.tensor([0, 1, 0]), 2)
    assert torch.equal(
        sharded_moe._top_idx(mask * torch.tensor([[1], [1], [3]]), 1), torch.tensor([[2, 1]])
    )
    assert sharded_moe._one_hot_to_float(torch.tensor([1]), 3).tolist() == [[0.0, 1.0, 0.0]]
    assert torch.equal(sharded_moe.einsum("se,se->s", mask, mask), torch.tensor([1, 1, 1]))
    assert sharded_moe._AllToAll is all_to_all._AllToAll
    calls = []

    def counted(tensor, op=None, group=None):
        calls.append((op, group))

    monkeypatch.setattr(sharded_moe.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(sharded_moe.dist, "all_reduce", counted)
    group = object()
    for gate in (
        lambda: top1gating(_overflowing_logits(), 1.0, 0, drop_tokens=False, ep_group=group),
        lambda: sharded_moe.top2gating(_overflowing_logits(), 1.0, 0, False, group),
        lambda: sharded_moe.topkgating(_overflowing_logits(), 2, 1.0, 0, False, group),
    ):
        gate()
    assert calls == [(sharded_moe.dist.ReduceOp.MAX, group)] * 3
