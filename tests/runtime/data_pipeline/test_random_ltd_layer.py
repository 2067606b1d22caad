"""RandomLayerTokenDrop on its own: the kept-token count, order, pass-through of dropped tokens,
the attention-mask cut, both hidden-state orders; the helpers' wrapping and state-dict names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from shardspeed.runtime.data_pipeline.data_routing.helper import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
)


class FixedLength:
    """A stand-in scheduler: keeps ``n`` tokens."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_current_seq(self) -> int:
        return self.n


class Probe(nn.Module):
    """Adds 1 to every token it sees; records the shapes and the mask it got."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.masks: list[torch.Tensor | None] = []

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        self.shapes.append(tuple(x.shape))
        self.masks.append(mask)
        return x + 1, "extra"


def _wrapped(
    order: str = "batch_seq_dim", mask: str | None = None
) -> tuple[RandomLayerTokenDrop, Probe]:
    probe = Probe()
    layer = RandomLayerTokenDrop(probe)
    config = {"hidden_state_order": order, "model_type": "decoder", "model_mask_name": mask}
    layer.init_config(config, FixedLength(3), 0)
    return layer, probe


def test_keeps_the_scheduled_tokens_in_order_and_passes_the_rest() -> None:
    layer, probe = _wrapped()
    x = torch.randn(2, 8, 4)
    out, extra = layer(x)
    assert probe.shapes == [(2, 3, 4)] and extra == "extra"
    kept = layer.last_kept_indices
    assert kept is not None and kept.shape == (2, 3)
    assert torch.all(kept[:, 1:] > kept[:, :-1])  # sorted: a causal layer keeps its meaning
    changed = (out != x).all(dim=-1)
    for b in range(2):
        assert changed[b].nonzero().flatten().tolist() == kept[b].tolist()
        assert torch.equal(out[b, kept[b]], x[b, kept[b]] + 1)


def test_seq_batch_order() -> None:
    layer, probe = _wrapped("seq_batch_dim")
    x = torch.randn(8, 2, 4)
    out, _ = layer(x)
    assert probe.shapes == [(3, 2, 4)]
    assert int((out != x).all(dim=-1).sum()) == 6


def test_mask_is_cut_to_the_kept_tokens() -> None:
    layer, probe = _wrapped(mask="mask")
    causal = torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8)
    layer(torch.randn(2, 8, 4), mask=causal)
    cut = probe.masks[0]
    assert cut is not None and cut.shape == (2, 1, 3, 3)
    kept = layer.last_kept_indices
    assert kept is not None
    for b in range(2):
        assert torch.equal(cut[b, 0], causal[b, 0][kept[b]][:, kept[b]])


def test_eval_short_sequences_and_unconfigured_layers_see_everything() -> None:
    layer, probe = _wrapped()
    layer(torch.randn(2, 3, 4))  # kept length >= sequence: whole
    layer.eval()
    layer(torch.randn(2, 8, 4))
    RandomLayerTokenDrop(probe)(torch.randn(2, 8, 4))
    assert probe.shapes == [(2, 3, 4), (2, 8, 4), (2, 8, 4)]


def test_gradients_reach_only_through_the_kept_tokens() -> None:
    lin = nn.Linear(4, 4)
    layer = RandomLayerTokenDrop(lin)
    layer.init_config({}, FixedLength(2), 0)
    x = torch.randn(1, 6, 4, requires_grad=True)
    layer(x).sum().backward()
    kept = layer.last_kept_indices
    assert kept is not None
    grad = x.grad
    assert grad is not None
    ones = torch.ones(4)
    for t in range(6):  # a dropped token is the identity; a kept one goes through lin
        expected = lin.weight.sum(dim=0) if t in kept[0].tolist() else ones
        assert torch.allclose(grad[0, t], expected)


def test_convert_wraps_outermost_layers_and_names_strip() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_random_ltd(model, nn.Linear)
    assert isinstance(model[0], RandomLayerTokenDrop) and isinstance(
        model[2][0], RandomLayerTokenDrop
    )
    assert "0.random_ltd_layer.weight" in model.state_dict()
    stripped = remove_random_ltd_state_dict(model.state_dict())
    assert stripped.keys() == plain.keys()
    assert all(torch.equal(stripped[k], plain[k]) for k in plain)


def test_bad_layer_options() -> None:
    layer = RandomLayerTokenDrop(nn.Identity())
    with pytest.raises(ValueError, match="hidden_state_order"):
        layer.init_config({"hidden_state_order": "batch_first"}, FixedLength(1), 0)
    with pytest.raises(ValueError, match="model_type"):
        layer.init_config({"model_type": "encoder-decoder"}, FixedLength(1), 0)
