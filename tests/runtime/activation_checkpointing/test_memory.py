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
