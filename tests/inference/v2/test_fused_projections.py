"""RaggedCausalLM runs q/k/v and gate/up as one matmul each (fused weights that share the
original linears' storage) where the linears allow it, and leaves other linears alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardspeed.inference.quantization import Int8Linear
from tests.inference.v2 import hf_models as hm
from tests.inference.v2.test_engine_v2 import ATOL, make_engine


def _check_logits(engine: Any, model: Any) -> None:
    seqs = {uid: hm.tokens(n, 7 + uid) for uid, n in enumerate([5, 19, 33])}
    logits = engine.put(list(seqs), list(seqs.values()))
    for row, ids in enumerate(seqs.values()):
        hm.assert_close(logits[row], hm.last_logits(model, ids), atol=ATOL, rtol=0)
    nxt = {uid: hm.tokens(1, 50 + uid) for uid in seqs}
    logits = engine.put(list(nxt), list(nxt.values()))
    for row, uid in enumerate(nxt):
        want = hm.last_logits(model, torch.cat([seqs[uid], nxt[uid]]))
        hm.assert_close(logits[row], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral"])
def test_projections_fused_sharing_storage(family: str) -> None:
    model = hm.build(family)
    engine = make_engine(model)
    lm = engine.model
    for i, layer in enumerate(lm.layers):
        attn = layer.self_attn
        qkv = lm._qkv[i]
        assert isinstance(qkv, nn.Linear)
        # the originals are views of the fused weight: no second copy of the weights
        assert attn.q_proj.weight.data_ptr() == qkv.weight.data_ptr()
        assert attn.v_proj.weight.untyped_storage().data_ptr() == qkv.weight.data_ptr()
        if family == "qwen2":  # biases fused too
            assert qkv.bias is not None
            assert attn.k_proj.bias.untyped_storage().data_ptr() == qkv.bias.data_ptr()
        gate_up = lm._gate_up[i]
        if family == "mixtral":  # MoE blocks run as they are
            assert gate_up is None
        else:
            assert isinstance(gate_up, nn.Linear)
            assert layer.mlp.gate_proj.weight.data_ptr() == gate_up.weight.data_ptr()
    _check_logits(engine, model)


def test_int8_projections_fused() -> None:
    model = hm.build("llama")
    for layer in model.model.layers:
        for owner, names in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
        ):
            for name in names:
                setattr(owner, name, Int8Linear.from_linear(getattr(owner, name)))
    engine = make_engine(model)
    assert all(isinstance(m, Int8Linear) for m in engine.model._qkv + engine.model._gate_up)
    _check_logits(engine, model)


class _Sharded(nn.Linear):
    """Stands for a linear of another kind (e.g. AutoTP's): not fused."""


def test_other_linears_left_unfused() -> None:
    model = hm.build("llama")
    for layer in model.model.layers:
        old = layer.self_attn.k_proj
        new = _Sharded(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        layer.self_attn.k_proj = new
    engine = make_engine(model)
    assert engine.model._qkv == [None, None]
    assert all(isinstance(m, nn.Linear) for m in engine.model._gate_up)
    _check_logits(engine, model)
