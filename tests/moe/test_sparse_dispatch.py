"""DeepSpeed's slot-based MoE helpers (``sharded_moe._route_slots``, ``_sparse_encode``,
``_sparse_decode``) and the gates' ``sparse_routes=True`` output, against the dense einsum
formulation DeepSpeed used before: forward values and gradients, with dropped routes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from shardspeed.moe import sharded_moe
from shardspeed.moe.sharded_moe import (
    _route_slots,
    _sparse_decode,
    _sparse_encode,
    top1gating,
    top2gating,
    topkgating,
)

TOKENS, EXPERTS, MODEL = 16, 4, 8


def _gate(logits: Tensor, k: int, sparse: bool, **kwargs: Any) -> tuple[Any, ...]:
    """The gate DeepSpeed uses for ``k``, deterministic (no RTS, no second-expert sampling)."""
    if k == 1:
        return top1gating(logits, use_rts=False, sparse_routes=sparse, **kwargs)
    if k == 2:
        return top2gating(logits, top2_2nd_expert_sampling=False, sparse_routes=sparse, **kwargs)
    return topkgating(logits, k, sparse_routes=sparse, **kwargs)


def _cases() -> list[Any]:
    cases = []
    for k in (1, 2, 3):
        cases.append(pytest.param(k, {"drop_tokens": True}, id=f"top{k}-drop"))
        cases.append(pytest.param(k, {"drop_tokens": False}, id=f"top{k}-nodrop"))
    cases.append(pytest.param(3, {"drop_policy": "position"}, id="top3-position"))
    return cases


def _routes(k: int, options: dict[str, Any], seed: int) -> tuple[Tensor, tuple, tuple]:
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(seed))
    dense = _gate(logits, k, False, capacity_factor=1.0, min_capacity=0, **options)
    sparse = _gate(logits, k, True, capacity_factor=1.0, min_capacity=0, **options)
    return logits, dense, sparse


@pytest.mark.parametrize("k, options", _cases())
def test_encode_decode_equal_the_dense_einsums(k: int, options: dict[str, Any]) -> None:
    _, dense, sparse = _routes(k, options, seed=k)
    combine_weights, dispatch_mask = dense[1], dense[2]
    capacity, indices, locations, gates = int(sparse[1]), sparse[3], sparse[4], sparse[5]
    assert len(indices) == len(locations) == len(gates) == k
    slots = _route_slots(indices, locations, EXPERTS, capacity)
    assert slots.dtype == torch.int64 and slots.shape == (k, TOKENS)
    if options.get("drop_tokens", True):
        assert (slots < 0).any(), "the case must drop routes to test them"
    else:
        assert (slots >= 0).all()

    hidden = torch.randn(TOKENS, MODEL)
    buffers = _sparse_encode(hidden, slots, EXPERTS, capacity)
    expected = torch.einsum("sec,sm->ecm", dispatch_mask.float(), hidden)
    assert buffers.shape == (EXPERTS, capacity, MODEL)
    torch.testing.assert_close(buffers, expected)

    expert_output = torch.randn_like(expected)
    flat = expert_output.view(EXPERTS * capacity, MODEL)
    combined = _sparse_decode(flat, slots, gates, TOKENS)
    torch.testing.assert_close(
        combined, torch.einsum("sec,ecm->sm", combine_weights, expert_output)
    )


@pytest.mark.parametrize("k, options", _cases())
def test_gradients_equal_the_dense_einsums(k: int, options: dict[str, Any]) -> None:
    """Gate logits -> dispatch -> per-expert linear -> combine, backward: the same gradients for
    the tokens, the gate logits and the expert weights."""
    logits, _, _ = _routes(k, options, seed=10 + k)
    generator = torch.Generator().manual_seed(20 + k)
    hidden = torch.randn(TOKENS, MODEL, generator=generator)
    weight = torch.randn(EXPERTS, MODEL, MODEL, generator=generator)
    grad_out = torch.randn(TOKENS, MODEL, generator=generator)
    gate_kwargs = {"capacity_factor": 1.0, "min_capacity": 0, **options}

    def run(sparse: bool) -> tuple[Tensor, ...]:
        x = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        lg = logits.clone().requires_grad_(True)
        out = _gate(lg, k, sparse, **gate_kwargs)
        if sparse:
            capacity = int(out[1])
            slots = _route_slots(out[3], out[4], EXPERTS, capacity)
            buffers = _sparse_encode(x, slots, EXPERTS, capacity)
            expert_output = torch.einsum("ecm,emn->ecn", buffers, w)
            y = _sparse_decode(expert_output.reshape(-1, MODEL), slots, out[5], TOKENS)
        else:
            combine_weights, dispatch_mask = out[1], out[2]
            buffers = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(x), x)
            expert_output = torch.einsum("ecm,emn->ecn", buffers, w)
            y = torch.einsum("sec,ecm->sm", combine_weights.type_as(x), expert_output)
        y.backward(grad_out)
        assert x.grad is not None and w.grad is not None and lg.grad is not None
        return y.detach(), x.grad, w.grad, lg.grad

    sparse, dense = run(True), run(False)
    for name, a, b in zip(
        ("output", "x.grad", "w.grad", "logits.grad"), sparse, dense, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert dense[3].abs().sum() > 0, "the gate must receive a gradient through the combine"


def _reconstruct(sparse: tuple[Any, ...]) -> Tensor:
    """Dense ``[S, E, C]`` combine weights rebuilt loop by loop from the per-route lists."""
    capacity, num_experts = int(sparse[1]), int(sparse[2])
    indices, locations, gates = sparse[3], sparse[4], sparse[5]
    dense = torch.zeros(indices[0].shape[0], num_experts, capacity)
    for idx, loc, gate in zip(indices, locations, gates, strict=True):
        for s in range(idx.shape[0]):
            if int(idx[s]) >= 0:
                dense[s, int(idx[s]), int(loc[s])] += gate[s]
    return dense


@pytest.mark.parametrize("k, options", _cases())
def test_sparse_routes_mark_drops_and_rebuild_the_dense_gate(
    k: int, options: dict[str, Any]
) -> None:
    _, dense, sparse = _routes(k, options, seed=30 + k)
    assert len(sparse) == 7
    l_aux, capacity, num_experts, indices, locations, gates, exp_counts = sparse
    torch.testing.assert_close(l_aux, dense[0])
    torch.testing.assert_close(exp_counts, dense[3])
    assert num_experts == EXPERTS and capacity == dense[1].shape[2]
    for idx, loc, gate in zip(indices, locations, gates, strict=True):
        assert idx.dtype == loc.dtype == torch.int64 and gate.dtype == torch.float32
        dropped = idx < 0
        assert (idx[dropped] == -1).all()
        assert (loc[dropped] == 0).all() and (gate[dropped] == 0).all()
        assert ((loc >= 0) & (loc < capacity)).all()
    torch.testing.assert_close(_reconstruct(sparse), dense[1])


def test_top1_unused_tokens_are_dropped_routes() -> None:
    logits = torch.randn(8, EXPERTS, generator=torch.Generator().manual_seed(3))
    used = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1])
    sparse = top1gating(logits, 4.0, 0, used_token=used, use_rts=False, sparse_routes=True)
    dense = top1gating(logits, 4.0, 0, used_token=used, use_rts=False)
    assert sparse[3][0][1] == -1 and sparse[3][0][4] == -1
    slots = _route_slots(sparse[3], sparse[4], EXPERTS, sparse[1])
    hidden = torch.randn(8, MODEL)
    expected = torch.einsum("sec,sm->ecm", dense[2].float(), hidden)
    torch.testing.assert_close(_sparse_encode(hidden, slots, EXPERTS, sparse[1]), expected)


def test_route_slots_by_hand() -> None:
    capacity = 3
    indices = [torch.tensor([0, 2, -1, 3, 1]), torch.tensor([1, 1, 0, 2, 4])]
    locations = [torch.tensor([0, 2, 0, 1, 3]), torch.tensor([2, 0, 1, -1, 0])]
    slots = _route_slots(indices, locations, num_experts=4, capacity=torch.tensor(capacity))
    # location 3 >= capacity, location -1, and expert 4 >= num_experts are all outside the buffer
    expected = torch.tensor([[0, 8, -1, 10, -1], [5, 3, 1, -1, -1]])
    assert torch.equal(slots, expected)
    # the [k, S] tensor form and int32 routes give the same slots
    as_tensors = _route_slots(torch.stack(indices).int(), torch.stack(locations).int(), 4, capacity)
    assert torch.equal(as_tensors, expected) and as_tensors.dtype == torch.int64


def test_encode_sums_a_shared_slot_and_decode_ignores_dropped_gates() -> None:
    tokens = torch.arange(6.0).reshape(3, 2)
    slots = torch.tensor([[0, 0, -1]])  # tokens 0 and 1 share slot 0, token 2 is dropped
    buffers = _sparse_encode(tokens, slots, 1, 2)
    assert torch.equal(buffers, torch.tensor([[[2.0, 4.0], [0.0, 0.0]]]))

    rows = torch.tensor([[1.0, 2.0], [float("nan"), 5.0]])
    gates = [torch.tensor([0.5, 2.0, 7.0])]  # the dropped route's gate must not leak in
    out = _sparse_decode(rows, slots, gates, 3)
    assert torch.equal(out, torch.tensor([[0.5, 1.0], [2.0, 4.0], [0.0, 0.0]]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_follows_the_dense_type_as(dtype: torch.dtype) -> None:
    _, dense, sparse = _routes(2, {"drop_tokens": True}, seed=5)
    capacity = int(sparse[1])
    slots = _route_slots(sparse[3], sparse[4], EXPERTS, capacity)
    hidden = torch.randn(TOKENS, MODEL).to(dtype)
    buffers = _sparse_encode(hidden, slots, EXPERTS, capacity)
    assert buffers.dtype == dtype
    expected = torch.einsum("sec,sm->ecm", dense[2].to(dtype).float(), hidden.float())
    torch.testing.assert_close(buffers.float(), expected)
    combined = _sparse_decode(buffers.reshape(-1, MODEL), slots, sparse[5], TOKENS)
    assert combined.dtype == dtype  # gates are cast to the expert outputs' dtype
    reference = torch.einsum("sec,ecm->sm", dense[1].to(dtype).float(), buffers.float())
    torch.testing.assert_close(combined.float(), reference, rtol=2e-2, atol=2e-2)


def test_shape_errors_name_the_argument() -> None:
    hidden = torch.randn(TOKENS, MODEL)
    with pytest.raises(ValueError, match="slots must be"):
        _sparse_encode(hidden, torch.zeros(2, TOKENS + 1, dtype=torch.long), EXPERTS, 4)
    with pytest.raises(ValueError, match="gates"):
        _sparse_decode(
            torch.randn(EXPERTS * 4, MODEL),
            torch.zeros(2, TOKENS, dtype=torch.long),
            [torch.ones(TOKENS)],
            TOKENS,
        )
    with pytest.raises(ValueError, match="same shape"):
        _route_slots([torch.zeros(3)], [torch.zeros(4)], EXPERTS, 4)
    with pytest.raises(ValueError, match="indices_ is empty"):
        _route_slots([], [], EXPERTS, 4)


def test_tutel_stays_refused_on_every_gate() -> None:
    logits = torch.randn(TOKENS, EXPERTS)
    for call in (
        lambda: top2gating(logits, 1.0, 0, use_tutel=True),
        lambda: topkgating(logits, 3, 1.0, 0, use_tutel=True),
    ):
        with pytest.raises(NotImplementedError, match="use_tutel"):
            call()
    assert sharded_moe.TUTEL_INSTALLED is False
