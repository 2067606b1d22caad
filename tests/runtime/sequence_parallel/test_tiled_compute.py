"""TiledMLP, sequence_tiled_compute and TiledFusedLogitsLoss against the untiled computation:
outputs, input gradients and parameter gradients equal in fp32, with uneven tiles, inputs
that need no gradient, and each parameter's gradient arriving once per backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.runtime.sequence_parallel.tiled_compute import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
    tile_bounds,
)

RTOL, ATOL = 1e-5, 1e-6


class GatedMLP(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int = 16, inner: int = 24) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=True)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def mlp_fn(module: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=name)


def count_arrivals(module: nn.Module) -> dict[str, int]:
    """How often each parameter's gradient is accumulated (what ZeRO's hooks see)."""
    counts = {n: 0 for n, _ in module.named_parameters()}
    for name, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda _p, name=name: counts.__setitem__(name, counts[name] + 1)
        )
    return counts


def test_tile_bounds_cut_like_torch_chunk():
    for length in (1, 5, 13, 16):
        for shards in (1, 2, 3, 4, 7, 20):
            sizes = [size for _, size in tile_bounds(length, shards)]
            assert sizes == [c.shape[0] for c in torch.arange(length).chunk(shards)]
    with pytest.raises(ValueError, match="shards must be >= 1"):
        tile_bounds(4, 0)
    with pytest.raises(TypeError, match="shards must be an int"):
        tile_bounds(4, 2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("shards", [1, 3, 4, 20])
@pytest.mark.parametrize("shape", [(2, 13, 16), (13, 16)])
def test_tiled_mlp_equals_untiled(shards: int, shape: tuple[int, ...]):
    torch.manual_seed(0)
    ref = GatedMLP()
    tiled = copy.deepcopy(ref)
    x = torch.randn(*shape)
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(*shape)

    out_ref = ref(x_ref)
    (out_ref * upstream).sum().backward()
    counts = count_arrivals(tiled)
    out = TiledMLP.apply(mlp_fn, tiled, x_tiled, shards, list(tiled.parameters()))
    (out * upstream).sum().backward()

    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    assert_grads_equal(grads(tiled), grads(ref))
    # one gradient arrival per parameter, however many tiles: ZeRO reduces on arrival
    assert set(counts.values()) == {1}


def test_tiled_mlp_input_without_grad_still_trains_parameters():
    torch.manual_seed(1)
    ref, tiled = GatedMLP(), None
    tiled = copy.deepcopy(ref)
    x = torch.randn(2, 9, 16)  # e.g. embeddings of a frozen layer
    ref(x).pow(2).sum().backward()
    out = TiledMLP.apply(mlp_fn, tiled, x, 4, None)
    out.pow(2).sum().backward()
    assert_grads_equal(grads(tiled), grads(ref))


def test_tiled_mlp_under_no_grad_has_no_graph():
    mlp = GatedMLP()
    x = torch.randn(1, 7, 16, requires_grad=True)
    with torch.no_grad():
        out = TiledMLP.apply(mlp_fn, mlp, x, 3, None)
    torch.testing.assert_close(out, mlp(x).detach(), rtol=RTOL, atol=ATOL)
    assert not out.requires_grad


def scaled_mlp(x: torch.Tensor, scale: torch.Tensor, module: GatedMLP) -> torch.Tensor:
    return mlp_fn(module, x) * scale


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute_joined_output(reduction: str | None):
    """Output joined on the sequence dimension, then reduced over all its elements."""
    torch.manual_seed(2)
    ref = GatedMLP()
    tiled = copy.deepcopy(ref)
    x = torch.randn(2, 11, 16)
    scale = torch.tensor(1.5)
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return t if reduction is None else getattr(t, reduction)()

    out_ref = reduce(scaled_mlp(x_ref, scale, ref))
    out = sequence_tiled_compute(
        scaled_mlp,
        seqlen=11,
        shards=4,
        kwargs_to_shard={"x": x_tiled},
        kwargs_to_pass={"scale": scale, "module": tiled},
        grad_requiring_tensor_key="x",
        compute_params=list(tiled.parameters()),
        output_unshard_dimension=1,
        output_reduction=reduction,
    )
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    upstream = torch.randn_like(out_ref)
    (out_ref * upstream).sum().backward()
    (out * upstream).sum().backward()
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    assert_grads_equal(grads(tiled), grads(ref))


def test_sequence_tiled_compute_loss_per_tile():
    """The loss case (dimension 0): tiles return token-loss sums over the whole count, "sum"
    is the exact mean; "mean" is the plain mean of the tiles' outputs (DeepSpeed's)."""
    torch.manual_seed(3)
    head = nn.Linear(8, 20)
    head_ref = copy.deepcopy(head)
    hidden = torch.randn(1, 10, 8)
    labels = torch.randint(0, 20, (1, 10))
    labels[0, :4] = -100  # the first tile counts fewer tokens
    count = int((labels != -100).sum())

    def tile_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).view(-1, 20)
        return F.cross_entropy(logits, y.reshape(-1), ignore_index=-100, reduction="sum") / count

    h_ref, h_tiled = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref = F.cross_entropy(head_ref(h_ref).view(-1, 20), labels.view(-1), ignore_index=-100)
    loss = sequence_tiled_compute(
        tile_loss, 10, 3, {"h": h_tiled, "y": labels}, {}, "h", [head.weight], 0, "sum"
    )
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    ref.backward()
    loss.backward()
    torch.testing.assert_close(h_tiled.grad, h_ref.grad, rtol=RTOL, atol=ATOL)
    assert_grads_equal(grads(head), grads(head_ref))

    head.zero_grad()
    h_mean = hidden.clone().requires_grad_()
    mean = sequence_tiled_compute(tile_loss, 10, 3, {"h": h_mean, "y": labels}, {}, "h", None, 0)
    tiles = torch.stack(
        [tile_loss(hidden[:, s : s + n], labels[:, s : s + n]) for s, n in tile_bounds(10, 3)]
    )
    torch.testing.assert_close(mean, tiles.mean(), rtol=RTOL, atol=ATOL)
    mean.backward()
    torch.testing.assert_close(h_mean.grad, h_ref.grad / 3, rtol=RTOL, atol=ATOL)


def test_sequence_tiled_compute_refuses_bad_arguments():
    x = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="output_reduction"):
        sequence_tiled_compute(lambda x: x, 4, 2, {"x": x}, {}, "x", None, 1, "max")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key 'y'"):
        sequence_tiled_compute(lambda x: x, 4, 2, {"x": x}, {}, "y", None, 1, None)
    with pytest.raises(ValueError, match=r"kwargs_to_shard\['x'\] must be a tensor of shape"):
        sequence_tiled_compute(lambda x: x, 5, 2, {"x": x}, {}, "x", None, 1, None)


VOCAB = 40


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(16, VOCAB, bias=False)

    def loss_fn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-100)


def shift(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's pre-shifted labels: position i holds label i + 1, -100 at the end."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()


def loss_case(seed: int = 4, seq: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    hidden = torch.randn(2, seq, 16)
    labels = torch.randint(0, VOCAB, (2, seq))
    labels[0, :9] = -100  # a prompt: counted tokens differ between tiles
    labels[1, 3:5] = -100
    return hidden, shift(labels)


@pytest.mark.parametrize("shards", [1, 3, 5, 34])
def test_tiled_fused_logits_loss_mean_is_exact_for_uneven_counts(shards: int):
    hidden, y = loss_case()
    ref_head = Head()
    head = copy.deepcopy(ref_head)
    h_ref, h = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref = ref_head.loss_fn(h_ref, y)
    counts = count_arrivals(head)
    loss = TiledFusedLogitsLoss.apply(
        Head.loss_fn, head, h, y, None, shards, [head.lm_head.weight], "mean"
    )
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    ref.backward()
    loss.backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=RTOL, atol=ATOL)
    assert_grads_equal(grads(head), grads(ref_head))
    assert set(counts.values()) == {1}
    if shards == 3:
        # the case is uneven: the plain mean of the tiles' means (DeepSpeed's) is not the loss
        rows_x, rows_y = hidden.reshape(-1, 16), y.reshape(-1)
        plain = torch.stack(
            [ref_head.loss_fn(rows_x[s : s + n], rows_y[s : s + n]) for s, n in tile_bounds(34, 3)]
        ).mean()
        assert not torch.allclose(plain, ref, rtol=1e-3)


def test_tiled_fused_logits_loss_sum_and_scaled_backward():
    hidden, y = loss_case(5)
    ref_head = Head()
    head = copy.deepcopy(ref_head)
    count = int((y != -100).sum())

    def sum_loss(self: Head, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        return F.cross_entropy(logits, t, ignore_index=-100, reduction="sum") / count

    h_ref, h = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref = ref_head.loss_fn(h_ref, y)
    loss = TiledFusedLogitsLoss.apply(sum_loss, head, h, y, None, 4, None, "sum")
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    # a scaled loss (loss scaler, 1 / gradient accumulation) scales every gradient
    (ref * 0.25).backward()
    (loss * 0.25).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=RTOL, atol=ATOL)
    assert_grads_equal(grads(head), grads(ref_head))


def test_tiled_fused_logits_loss_with_mask_and_frozen_input():
    hidden, y = loss_case(6)
    mask = torch.ones(y.shape, dtype=torch.bool)
    mask[1, 10:] = False
    ref_head = Head()
    head = copy.deepcopy(ref_head)

    def masked_loss(self: Head, x: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(x, t.masked_fill(~m, -100))

    ref = ref_head.loss_fn(hidden, y.masked_fill(~mask, -100))
    loss = TiledFusedLogitsLoss.apply(masked_loss, head, hidden, y, mask, 3, None, "mean")
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    assert loss.requires_grad  # the head trains though the hidden states need no gradient
    ref.backward()
    loss.backward()
    assert_grads_equal(grads(head), grads(ref_head))


def test_tiled_fused_logits_loss_all_ignored_and_no_grad():
    hidden, y = loss_case(7)
    head = Head()
    h = hidden.clone().requires_grad_()
    ignored = torch.full_like(y, -100)
    loss = TiledFusedLogitsLoss.apply(Head.loss_fn, head, h, ignored, None, 3, None, "mean")
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(h.grad) == 0
    assert head.lm_head.weight.grad is None or torch.count_nonzero(head.lm_head.weight.grad) == 0

    with torch.no_grad():
        value = TiledFusedLogitsLoss.apply(Head.loss_fn, head, h, y, None, 3, None, "mean")
    assert not value.requires_grad
    torch.testing.assert_close(value, head.loss_fn(h, y).detach(), rtol=RTOL, atol=ATOL)


def test_tiled_fused_logits_loss_refuses_bad_arguments():
    hidden, y = loss_case(8)
    head = Head()
    with pytest.raises(ValueError, match="output_reduction"):
        TiledFusedLogitsLoss.apply(Head.loss_fn, head, hidden, y, None, 2, None, "none")
    with pytest.raises(ValueError, match="agree on"):
        TiledFusedLogitsLoss.apply(Head.loss_fn, head, hidden, y[:, :-1], None, 2, None, "mean")
    with pytest.raises(ValueError, match="mask must be"):
        TiledFusedLogitsLoss.apply(Head.loss_fn, head, hidden, y, y[:1], 2, None, "mean")


def test_sequence_tiled_compute_input_without_grad_still_trains_parameters():
    torch.manual_seed(9)
    ref = GatedMLP()
    tiled = copy.deepcopy(ref)
    x = torch.randn(2, 7, 16)
    scale = torch.tensor(2.0)
    scaled_mlp(x, scale, ref).sum().backward()
    out = sequence_tiled_compute(
        scaled_mlp, 7, 3, {"x": x}, {"scale": scale, "module": tiled}, "x", None, 1, "sum"
    )
    assert out.requires_grad
    out.backward()
    assert_grads_equal(grads(tiled), grads(ref))
    assert x.grad is None
