"""The ragged forward runs Hugging Face's RMSNorm layers as ``F.rms_norm`` (one fused kernel on
CUDA instead of seven), with the layer's own arithmetic: float32 equal to the layer's output,
bf16 equal after the same cast; any other norm layer runs as itself."""

from __future__ import annotations

import pytest
import torch

from shardspeed.inference.v2.model.ragged_lm import _norm
from tests.inference.v2 import hf_models as hm


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_layer(family: str, dtype: torch.dtype) -> None:
    model = hm.build(family).to(dtype)
    layer = model.model.layers[0]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm]
    if hasattr(layer.self_attn, "q_norm"):
        norms.append(layer.self_attn.q_norm)
    torch.manual_seed(0)
    with torch.no_grad():
        for norm in norms:
            norm.weight.uniform_(0.5, 1.5)  # not all ones: the weight's place matters
            x = torch.randn(7, norm.weight.shape[0], dtype=dtype) * 3
            want = norm(x)
            got = _norm(norm, x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(
                got,
                want,
                atol=1e-6 if dtype == torch.float32 else 0,
                rtol=1e-6 if dtype == torch.float32 else 0,
            )


def test_other_norms_run_as_themselves() -> None:
    layer_norm = hm.build("gpt2").transformer.ln_f
    x = torch.randn(3, layer_norm.weight.shape[0])
    assert torch.equal(_norm(layer_norm, x), layer_norm(x))
