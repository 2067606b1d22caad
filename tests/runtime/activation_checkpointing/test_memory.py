"""Saved-activation bytes of a deep MLP with and without checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardspeed.checkpointing as ckpt
from tests.runtime.activation_checkpointing.models import count_saved, deep_mlp

BATCH, WIDTH, LAYERS = 32, 64, 16
ACTIVATION = BATCH * WIDTH * 4  # bytes of one fp32 [batch, width] activation


def _saved_bytes(segment: int) -> int:
    """Saved non-parameter bytes of one forward; ``segment`` layers per checkpoint (0: none)."""
    torch.manual_seed(0)
    model = nn.Sequential(*deep_mlp(WIDTH, LAYERS))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    with count_saved(model) as saved:
        h = x
        if segment == 0:
            h = model(h)
        else:
            for start in range(0, LAYERS, segment):
                h = ckpt.checkpoint(model[start : start + segment], h)
    h.sum().backward()
    return saved["bytes"]


@pytest.mark.parametrize("segment", [1, 4])
def test_checkpointing_saves_less_by_the_expected_factor(segment: int) -> None:
    plain = _saved_bytes(0)
    # Linear keeps its input and Tanh its output: two activations per layer
    assert plain == 2 * LAYERS * ACTIVATION
    checkpointed = _saved_bytes(segment)
    # a checkpoint keeps only its input: one activation per segment
    assert checkpointed == (LAYERS // segment) * ACTIVATION
    assert plain / checkpointed == 2 * segment


def _gpt_activation_bytes(checkpoint_every_block: bool) -> tuple[int, float]:
    """Saved activation bytes and loss of one forward of a 12-layer GPT (dropout on)."""
    from examples.gpt_model import GPT, GPTConfig
    from tests.runtime.activation_checkpointing.models import Checkpointed

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=12, n_head=4, n_embd=64, dropout=0.1)
    model = GPT(cfg)
    model.blocks = nn.ModuleList(Checkpointed(b, checkpoint_every_block) for b in model.blocks)
    tokens = torch.randint(
        cfg.vocab_size, (4, cfg.block_size), generator=torch.Generator().manual_seed(1)
    )
    with count_saved(model) as saved:
        loss = model(tokens, tokens)
    loss.backward()
    return saved["bytes"], loss.item()


def test_gpt_12_layers_one_checkpoint_per_layer_saves_over_2x() -> None:
    plain, loss_plain = _gpt_activation_bytes(False)
    checkpointed, loss_ckpt = _gpt_activation_bytes(True)
    ratio = plain / checkpointed
    print(f"12-layer GPT saved activations: {plain} B -> {checkpointed} B ({ratio:.1f}x)")
    assert loss_plain == loss_ckpt  # same dropout masks, same forward
    assert ratio >= 2.0
