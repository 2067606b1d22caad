"""Activation checkpoint offload to host (DeepSpeed's CheckpointHiddenStatesOffload): on CPU
with offload_host_tensors the checkpoints' saved inputs are copied away and back, gradients
are identical to the run without it, and only the marked inputs move."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from shardspeed.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)

LAYERS = 3


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def step(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_hf_checkpointed_layers_offload_their_hidden_states():
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 16))
    want = step(model, ids)
    with CheckpointHiddenStatesOffload(offload_host_tensors=True, min_offload_bytes=0) as ctx:
        got = step(model, ids)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name
    stats = ctx.stats
    # one hidden-states input per layer: the last stays, the others go to host and back
    assert stats.marked_tensors == LAYERS
    assert stats.offloaded_tensors == LAYERS - 1 == stats.restored_tensors
    assert stats.kept_last_tensors == 1
    assert stats.offloaded_bytes == (LAYERS - 1) * 2 * 16 * 32 * 4
    assert stats.saved_tensors_seen > LAYERS  # other saved tensors passed untouched
    # the marker is taken off again: no context, no marks
    with CheckpointHiddenStatesOffload(offload_host_tensors=True) as plain:
        pass
    assert step(model, ids).keys() == want.keys() and plain.stats.marked_tensors == 0


@pytest.mark.timeout(60)
def test_marked_checkpoint_input_is_held_on_host_until_backward():
    torch.manual_seed(1)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    want = x.grad.clone(), layer[0].weight.grad.clone()
    x.grad, layer[0].weight.grad, layer[0].bias.grad = None, None, None

    ctx = get_checkpoint_hidden_states_offloading_ctx_manager(keep_last_count=0)
    ctx.offload_host_tensors, ctx.min_offload_bytes = True, 0
    with ctx:
        hidden = x * 1.0
        ctx.mark(hidden)
        out = checkpoint(layer, hidden, use_reentrant=False)
        assert ctx.host_bytes() == hidden.numel() * 4  # away during forward
        out.sum().backward()
        assert ctx.host_bytes() == 0
    assert ctx.stats.offloaded_tensors == 1 == ctx.stats.restored_tensors
    assert torch.equal(x.grad, want[0]) and torch.equal(layer[0].weight.grad, want[1])


def test_backward_outside_the_context_is_refused():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with CheckpointHiddenStatesOffload(
        offload_host_tensors=True, keep_last_count=0, min_offload_bytes=0
    ) as ctx:
        hidden = x * 1.0
        ctx.mark(hidden)
        out = checkpoint(layer, hidden, use_reentrant=False)
    with pytest.raises(RuntimeError, match="same CheckpointHiddenStatesOffload context"):
        out.sum().backward()
    with pytest.raises(ValueError, match="keep_last_count must be >= 0"):
        CheckpointHiddenStatesOffload(keep_last_count=-1)
