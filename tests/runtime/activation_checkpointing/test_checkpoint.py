"""checkpoint(): gradients equal a plain run exactly, dropout included, with any argument mix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardspeed.checkpointing as ckpt
from examples.gpt_model import GPT, Block, GPTConfig
from tests.runtime.activation_checkpointing.models import (
    Checkpointed,
    assert_same,
    count_saved,
    deep_mlp,
    grads,
    run_twice,
)

GPT_DROPOUT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.2)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_mlp_gradients_equal(dropout: float) -> None:
    x = torch.randn(8, 16)

    def build() -> nn.Module:
        return nn.Sequential(*deep_mlp(16, 4, dropout))

    def step(model: nn.Module, enabled: bool) -> torch.Tensor:
        h = x  # no input requires grad: the parameters' gradients must still arrive
        for block in model:
            h = ckpt.checkpoint(block, h) if enabled else block(h)
        return h.square().mean()

    (loss_a, grads_a), (loss_b, grads_b) = run_twice(build, step)
    assert torch.equal(loss_a, loss_b)
    assert_same(grads_a, grads_b)


def test_gpt_block_with_dropout_gradients_equal() -> None:
    x = torch.randn(2, 16, 32)

    def step(model: nn.Module, enabled: bool) -> torch.Tensor:
        inp = x.clone().requires_grad_(True)
        out = ckpt.checkpoint(model, inp) if enabled else model(inp)
        loss = out.pow(2).mean()
        return loss

    (loss_a, grads_a), (loss_b, grads_b) = run_twice(lambda: Block(GPT_DROPOUT), step)
    assert torch.equal(loss_a, loss_b)
    assert_same(grads_a, grads_b)


def test_gpt_model_with_checkpointed_blocks() -> None:
    tokens = torch.randint(64, (2, 16))

    def build() -> nn.Module:
        return GPT(GPT_DROPOUT)

    def step(model: nn.Module, enabled: bool) -> torch.Tensor:
        model.blocks = nn.ModuleList(Checkpointed(b, enabled) for b in model.blocks)
        return model(tokens, tokens)

    (loss_a, grads_a), (loss_b, grads_b) = run_twice(build, step)
    assert torch.equal(loss_a, loss_b)
    assert_same(grads_a, grads_b)


def test_rng_streams_after_checkpoint_match_plain_run() -> None:
    """Recompute restores the RNG it found, so dropout after backward draws as without it."""
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(3)
    block(x).sum().backward()
    after_plain = torch.rand(5)
    torch.manual_seed(3)
    ckpt.checkpoint(block, x).sum().backward()
    assert torch.equal(torch.rand(5), after_plain)


class Mixed(nn.Module):
    """Takes and returns tensors mixed with None, ints, strings and nested tuples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, mask, pair, scale, unused, tag):  # noqa: ANN001, ANN201 - test fixture
        assert unused is None and tag == "t"
        a, (b, k) = pair
        y = torch.tanh(self.lin(x)) * scale + a * b * k
        count = torch.tensor(x.shape[0])  # integer output: never differentiable
        return y.masked_fill(mask, 0.0), (count, None, 3), mask.float(), "done"


def test_non_tensor_arguments_and_outputs() -> None:
    torch.manual_seed(0)
    reference = Mixed()
    x = torch.randn(4, 6, requires_grad=True)
    a = torch.randn(4, 6, requires_grad=True)
    b = torch.randn(4, 6)  # needs no gradient
    mask = torch.rand(4, 6) > 0.7
    outs = []
    for enabled in (False, True):
        model = Mixed()
        model.load_state_dict(reference.state_dict())
        x.grad = a.grad = None
        args = (x, mask, (a, (b, 2)), 0.5, None, "t")
        out = ckpt.checkpoint(model, *args) if enabled else model(*args)
        y, (count, nothing, three), mask_f, word = out
        assert (nothing, three, word) == (None, 3, "done")
        assert count.dtype == torch.int64 and not count.requires_grad
        assert torch.equal(mask_f, mask.float())
        y.sum().backward()
        outs.append((y.detach(), x.grad.clone(), a.grad.clone(), grads(model)))
    assert b.grad is None
    assert_same(list(outs[0][:3]), list(outs[1][:3]))
    assert_same(outs[0][3], outs[1][3])


def test_single_output_and_unused_outputs() -> None:
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    y, z = ckpt.checkpoint(lambda t: (lin(t), lin(t) * 2), x)
    y.sum().backward()  # z gets no gradient: its grad arrives as None
    expected = lin.weight.grad.clone()
    lin.weight.grad = None
    lin(x).sum().backward()
    assert torch.equal(lin.weight.grad, expected)
    assert isinstance(ckpt.checkpoint(lin, x), torch.Tensor)
    assert z.requires_grad


def test_no_grad_runs_plainly() -> None:
    lin = nn.Linear(3, 3)
    with torch.no_grad():
        out = ckpt.checkpoint(lin, torch.randn(2, 3))
    assert not out.requires_grad
    assert ckpt.get_stats().checkpoints == 0


def test_recompute_calls_module_again_so_hooks_fire() -> None:
    """A ZeRO-3 pre-forward hook must run in the recompute (it re-gathers parameters there)."""
    lin = nn.Linear(3, 3)
    calls: list[bool] = []
    lin.register_forward_pre_hook(lambda mod, args: calls.append(torch.is_grad_enabled()))
    ckpt.checkpoint(lin, torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert calls == [False, True]  # forward without autograd, recompute with it
    assert ckpt.get_stats().recomputes == 1


def test_autograd_grad_is_refused_with_a_hint() -> None:
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="non_reentrant_checkpoint"):
        torch.autograd.grad(ckpt.checkpoint(lin, x).sum(), x)


def test_non_reentrant_checkpoint_replays_tracker_stream() -> None:
    ckpt.model_parallel_cuda_manual_seed(11)

    class TrackedDropout(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            with ckpt.get_cuda_rng_tracker().fork():
                return nn.functional.dropout(self.lin(t), 0.5)

    torch.manual_seed(0)
    ref = TrackedDropout()
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for fn in (None, ckpt.checkpoint, ckpt.non_reentrant_checkpoint):
        model = TrackedDropout()
        model.load_state_dict(ref.state_dict())
        ckpt.model_parallel_cuda_manual_seed(11)
        x.grad = None
        out = model(x) if fn is None else fn(model, x)
        out.sum().backward()
        gx = x.grad
        results.append((out.detach(), gx.clone()))
    for out, gx in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(gx, results[0][1])


def test_nested_checkpoints_gradients_equal() -> None:
    def build() -> nn.Module:
        return nn.Sequential(*deep_mlp(8, 4, dropout=0.2))

    def step(model: nn.Module, enabled: bool) -> torch.Tensor:
        x = torch.ones(2, 8, requires_grad=True)
        if not enabled:
            return model(x).sum()

        def outer(t: torch.Tensor) -> torch.Tensor:
            t = ckpt.checkpoint(model[:2], t)
            return ckpt.checkpoint(model[2:], t)

        return ckpt.checkpoint(outer, x).sum()

    (loss_a, grads_a), (loss_b, grads_b) = run_twice(build, step)
    assert torch.equal(loss_a, loss_b)
    assert_same(grads_a, grads_b)


def test_only_inputs_are_saved_never_parameters() -> None:
    block = nn.Sequential(*deep_mlp(8, 3))
    x = torch.randn(2, 8, requires_grad=True)
    with count_saved() as saved:  # parameters not excluded: any saved weight would count
        out = ckpt.checkpoint(block, x)
    assert (saved["tensors"], saved["bytes"]) == (1, x.numel() * 4)
    out.sum().backward()
    assert all(p.grad is not None for p in block.parameters())
