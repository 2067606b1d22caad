"""top1/top2/topk gating equal the loop-by-loop dense reference on fixed inputs."""

from __future__ import annotations

import pytest
import torch

from shardspeed.moe import top1gating, top2gating, topkgating
from shardspeed.moe.gating import capacity_for, route_top1
from shardspeed.moe.sharded_moe import TopKGate
from tests.moe.reference import DenseGate, reference_gating

NUM_TOKENS, NUM_EXPERTS = 24, 4


def _logits(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=generator)
    logits[:, 0] += 1.0  # skew towards expert 0 so capacity drops tokens
    return logits


def _assert_matches(got: tuple[torch.Tensor, ...], want: DenseGate) -> None:
    l_aux, combine, dispatch_mask, exp_counts = got
    assert combine.shape == want.combine.shape
    torch.testing.assert_close(combine.double(), want.combine, rtol=1e-6, atol=1e-7)
    assert torch.equal(dispatch_mask, want.combine > 0)
    assert exp_counts.tolist() == want.exp_counts
    assert float(l_aux) == pytest.approx(want.l_aux, rel=1e-6)


def test_capacity_rule() -> None:
    assert capacity_for(24, 4, 1.0, 4) == 6
    assert capacity_for(24, 4, 1.1, 4) == 7  # ceil(6.6)
    assert capacity_for(8, 4, 1.0, 4) == 4  # floored at min_capacity
    assert capacity_for(24, 4, 2.0, 0) == 12


@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("capacity_factor", [1.0, 0.5])
def test_top1_matches_reference(drop_tokens: bool, capacity_factor: float) -> None:
    logits = _logits()
    got = top1gating(logits, capacity_factor, 2, drop_tokens=drop_tokens, use_rts=False)
    want = reference_gating(logits, 1, capacity_factor, 2, drop_tokens)
    _assert_matches(got, want)
    routed = int(got[2].sum())
    assert (routed < NUM_TOKENS) if drop_tokens else (routed == NUM_TOKENS)


def test_top1_used_token_masks_tokens() -> None:
    logits = _logits(1)
    used = torch.ones(NUM_TOKENS)
    used[::3] = 0
    got = top1gating(logits, 1.0, 2, used_token=used, drop_tokens=False, use_rts=False)
    want = reference_gating(logits, 1, 1.0, 2, False, used_token=used)
    _assert_matches(got, want)
    assert not got[2][::3].any()


def test_top1_random_token_selection_keeps_capacity() -> None:
    logits = _logits(2)
    torch.manual_seed(0)
    routing = route_top1(logits, 1.0, 2, use_rts=True)
    per_expert = torch.bincount(routing.experts[routing.kept], minlength=NUM_EXPERTS)
    assert int(per_expert.max()) <= routing.capacity
    expected = torch.clamp(routing.exp_counts, max=routing.capacity)
    assert per_expert.tolist() == expected.tolist()


def test_top1_refuses_fewer_tokens_than_min_capacity() -> None:
    with pytest.raises(ValueError, match="min_capacity"):
        top1gating(_logits()[:3], 1.0, 4, use_rts=False)


@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("capacity_factor", [1.0, 0.5])
def test_top2_matches_reference(drop_tokens: bool, capacity_factor: float) -> None:
    logits = _logits(3)
    got = top2gating(
        logits, capacity_factor, 2, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False
    )
    want = reference_gating(logits, 2, capacity_factor, 2, drop_tokens)
    _assert_matches(got, want)
    routed = int(got[2].sum())
    assert (routed < 2 * NUM_TOKENS) if drop_tokens else (routed == 2 * NUM_TOKENS)


def test_top2_sampling_leaves_the_input_logits_alone() -> None:
    logits = _logits(4)
    before = logits.clone()
    l_aux, combine, _, exp_counts = top2gating(logits, 1.0, 2)
    assert torch.equal(logits, before)
    assert int(exp_counts.sum()) == 2 * NUM_TOKENS
    torch.testing.assert_close(
        combine.sum(dim=(1, 2))[combine.sum(dim=(1, 2)) > 0].max(), torch.tensor(1.0)
    )


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_topk_matches_reference(k: int, drop_tokens: bool, drop_policy: str) -> None:
    logits = _logits(5)
    got = topkgating(logits, k, 0.75, 2, drop_tokens=drop_tokens, drop_policy=drop_policy)
    want = reference_gating(logits, k, 0.75, 2, drop_tokens, drop_policy=drop_policy, kind="topk")
    _assert_matches(got, want)
    routed = int(got[2].sum())
    assert (routed < k * NUM_TOKENS) if drop_tokens else (routed == k * NUM_TOKENS)


def test_topk_refuses_unknown_drop_policy() -> None:
    with pytest.raises(ValueError, match="drop_policy"):
        topkgating(_logits(), 2, 1.0, 2, drop_policy="random")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gate_uses_eval_capacity_factor_in_eval(k: int) -> None:
    torch.manual_seed(0)
    gate = TopKGate(
        8, NUM_EXPERTS, k=k, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0
    )
    gate.use_rts = False
    gate.top2_2nd_expert_sampling = False
    x = torch.randn(NUM_TOKENS, 8)
    gate.train()
    train_capacity = gate(x)[1].shape[2]
    gate.eval()
    eval_capacity = gate(x)[1].shape[2]
    assert train_capacity == capacity_for(NUM_TOKENS, NUM_EXPERTS, 0.5 * (k if k > 1 else 1), 0)
    assert eval_capacity == capacity_for(NUM_TOKENS, NUM_EXPERTS, 2.0 * (k if k > 1 else 1), 0)
