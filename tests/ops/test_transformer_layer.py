"""``shardspeed.ops.transformer``: DeepSpeedTransformerLayer's forward and backward equal a
reference built from torch modules (separate q/k/v linears, SDPA, nn.LayerNorm, tanh GeLU), in
its Pre-LN and Post-LN orders; DeepSpeed's config fields, parameter names and constructor."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

HIDDEN, HEADS, INNER = 64, 4, 256


class Reference(nn.Module):
    """A BERT encoder layer from torch modules, Pre-LN or Post-LN."""

    def __init__(self, pre_layer_norm: bool) -> None:
        super().__init__()
        self.pre = pre_layer_norm
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.attn_norm, self.norm = nn.LayerNorm(HIDDEN, eps=1e-12), nn.LayerNorm(HIDDEN, eps=1e-12)
        self.inter, self.output = nn.Linear(HIDDEN, INNER), nn.Linear(INNER, HIDDEN)
        self.gelu = nn.GELU(approximate="tanh")
        for module in (self.attn_norm, self.norm):  # not the trivial 1 / 0
            nn.init.normal_(module.weight, 1.0, 0.1)
            nn.init.normal_(module.bias, 0.0, 0.1)

    def attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, HEADS, HIDDEN // HEADS).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), attn_mask=mask
        )
        return self.o(out.transpose(1, 2).reshape(batch, seq, HIDDEN))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre:
            h = x + self.attention(self.norm(x), mask)
            return h + self.output(self.gelu(self.inter(self.attn_norm(h))))
        a = self.attn_norm(x + self.attention(x, mask))
        return self.norm(a + self.output(self.gelu(self.inter(a))))

    def initial(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """DeepSpeed's ``initial_weights`` / ``initial_biases`` (copies)."""
        modules = [self.q, self.k, self.v, self.o, self.attn_norm, self.inter, self.output]
        modules.append(self.norm)
        weights = [nn.Parameter(m.weight.detach().clone()) for m in modules]
        return weights, [nn.Parameter(m.bias.detach().clone()) for m in modules]

    def grads_by_deepspeed_name(self) -> dict[str, torch.Tensor]:
        qkv = [self.q, self.k, self.v]
        return {
            "attn_qkvw": torch.cat([m.weight.grad for m in qkv]),
            "attn_qkvb": torch.cat([m.bias.grad for m in qkv]),
            "attn_ow": self.o.weight.grad,
            "attn_ob": self.o.bias.grad,
            "attn_nw": self.attn_norm.weight.grad,
            "attn_nb": self.attn_norm.bias.grad,
            "inter_w": self.inter.weight.grad,
            "inter_b": self.inter.bias.grad,
            "output_w": self.output.weight.grad,
            "output_b": self.output.bias.grad,
            "norm_w": self.norm.weight.grad,
            "norm_b": self.norm.bias.grad,
        }


def _config(**overrides) -> DeepSpeedTransformerConfig:
    fields = {
        "batch_size": 3,
        "hidden_size": HIDDEN,
        "intermediate_size": INNER,
        "heads": HEADS,
        "attn_dropout_ratio": 0.0,
        "hidden_dropout_ratio": 0.0,
        "num_hidden_layers": 2,
        "initializer_range": 0.02,
    }
    return DeepSpeedTransformerConfig(**(fields | overrides))


def _bert_mask(batch: int, seq: int) -> torch.Tensor:
    """BERT's extended additive mask (batch, 1, 1, seq): 0 for tokens, -10000 for padding."""
    keep = torch.ones(batch, seq)
    keep[0, -3:] = 0
    keep[2, -1:] = 0
    return (1.0 - keep)[:, None, None, :] * -10000.0


@pytest.mark.parametrize("pre_layer_norm", [True, False], ids=["pre-ln", "post-ln"])
@pytest.mark.parametrize("checkpoints", [False, True], ids=["plain", "gelu-attn-checkpoint"])
def test_forward_and_backward_equal_the_reference(pre_layer_norm, checkpoints):
    torch.manual_seed(0)
    reference = Reference(pre_layer_norm)
    config = _config(
        pre_layer_norm=pre_layer_norm,
        gelu_checkpoint=checkpoints,
        attn_dropout_checkpoint=checkpoints,
    )
    layer = DeepSpeedTransformerLayer(config, *reference.initial())
    x = torch.randn(3, 10, HIDDEN)
    mask = _bert_mask(3, 10)
    x_ref, x_ds = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want, got = reference(x_ref, mask), layer(x_ds, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(want)
    want.backward(upstream)
    got.backward(upstream)
    torch.testing.assert_close(x_ds.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for name, grad in reference.grads_by_deepspeed_name().items():
        torch.testing.assert_close(getattr(layer, name).grad, grad, rtol=1e-5, atol=1e-5)


def test_half_precision_layer_with_an_fp32_mask():
    """A layer cast to bf16 (as a model is with ``fp16``/bf16 training) keeps its dtype even
    with BERT's fp32 extended mask, and stays close to the fp32 layer."""
    torch.manual_seed(0)
    layer = DeepSpeedTransformerLayer(_config())
    x, mask = torch.randn(3, 10, HIDDEN), _bert_mask(3, 10)
    want = layer(x, mask)
    out = layer.to(torch.bfloat16)(x.to(torch.bfloat16), mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=0.05, atol=0.05)
    out.float().sum().backward()
    assert layer.attn_qkvw.grad.dtype == torch.bfloat16


def test_parameters_names_shapes_and_initialisation():
    torch.manual_seed(0)
    config = _config(hidden_size=256, heads=8, intermediate_size=-1, num_hidden_layers=8)
    layer = DeepSpeedTransformerLayer(config)
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {
        "attn_qkvw": (768, 256),
        "attn_qkvb": (768,),
        "attn_ow": (256, 256),
        "attn_ob": (256,),
        "attn_nw": (256,),
        "attn_nb": (256,),
        "inter_w": (1024, 256),  # intermediate_size <= 0: 4 x hidden
        "inter_b": (1024,),
        "output_w": (256, 1024),
        "output_b": (256,),
        "norm_w": (256,),
        "norm_b": (256,),
    }
    assert layer.attn_qkvw.std().item() == pytest.approx(0.02, rel=0.05)
    # adjust_init_range: the output projections start at 0.02 / sqrt(2 * 8)
    assert layer.output_w.std().item() == pytest.approx(0.005, rel=0.05)
    assert torch.equal(layer.norm_w, torch.ones(256)) and not layer.attn_ob.any()
    unadjusted = DeepSpeedTransformerLayer(_config(adjust_init_range=False, num_hidden_layers=8))
    assert unadjusted.attn_ow.std().item() == pytest.approx(0.02, rel=0.1)


def test_layer_ids_return_tuple_and_dropout_modes():
    first = DeepSpeedTransformerLayer(_config())
    second = DeepSpeedTransformerLayer(_config(return_tuple=True, hidden_dropout_ratio=0.5))
    assert second.config.layer_id == first.config.layer_id + 1
    assert DeepSpeedTransformerLayer.layer_id == second.config.layer_id + 1
    x = torch.randn(2, 5, HIDDEN)
    out = second(x)
    assert isinstance(out, tuple) and len(out) == 1
    assert second.config.training  # the module's mode, recorded at forward
    assert not torch.allclose(second(x)[0], out[0])  # dropout draws afresh in training
    second.eval()
    with torch.no_grad():
        assert torch.equal(second(x)[0], second(x)[0])
    assert not second.config.training and not second.config.is_grad_enabled


def test_grads_hook_collects_deepspeed_names():
    layer = DeepSpeedTransformerLayer(_config())
    grads: list = []
    layer(torch.randn(2, 4, HIDDEN), grads=grads).sum().backward()
    names = {name for _, name in grads}
    assert names == {"V_W", "V_B", "O_W", "O_B", "N2_W", "N2_B", "int_W", "int_B", "out_W"} | {
        "out_B",
        "norm_W",
        "norm_B",
    }
    v_w = next(g for g, name in grads if name == "V_W")
    torch.testing.assert_close(v_w, layer.attn_qkvw.grad[2 * HIDDEN :])


def test_config_fields_from_dict_and_json(tmp_path):
    config = DeepSpeedTransformerConfig()
    assert (config.batch_size, config.hidden_size, config.heads) == (-1, -1, -1)
    assert config.layer_norm_eps == 1e-12 and config.pre_layer_norm and config.adjust_init_range
    assert not (config.fp16 or config.return_tuple or config.stochastic_mode)
    assert config.training and config.local_rank == -1 and config.seed == -1
    fields = {"hidden_size": 32, "heads": 2, "intermediate_size": 64, "pre_layer_norm": False}
    assert DeepSpeedTransformerConfig.from_dict(fields).hidden_size == 32
    for encoding in ("utf-16", "utf-8"):
        path = tmp_path / f"{encoding}.json"
        path.write_text(json.dumps(fields), encoding=encoding)
        loaded = DeepSpeedTransformerConfig.from_json_file(path)
        assert not loaded.pre_layer_norm and loaded.intermediate_size == 64


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="hidden_size and heads > 0"):
        DeepSpeedTransformerLayer(DeepSpeedTransformerConfig())
    with pytest.raises(ValueError, match="not divisible by heads=3"):
        DeepSpeedTransformerLayer(_config(heads=3))
    with pytest.raises(ValueError, match="initializer_range=-1"):
        DeepSpeedTransformerLayer(_config(initializer_range=-1))
    with pytest.raises(ValueError, match="8 tensors each"):
        DeepSpeedTransformerLayer(_config(), initial_weights=[torch.zeros(1)])
    layer = DeepSpeedTransformerLayer(_config())
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        layer(torch.randn(1, 2, HIDDEN), encoder_hidden_states=torch.randn(1, 2, HIDDEN))


def test_post_ln_equals_hugging_face_bert_layer():
    """Post-LN is BERT's layer: Hugging Face's BertLayer (tanh GeLU, eager attention, BERT's
    additive mask) with the same weights gives the same output."""
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        intermediate_size=INNER,
        hidden_act="gelu_new",
        layer_norm_eps=1e-12,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    bert = BertLayer(config).eval()
    for name, param in bert.named_parameters():
        nn.init.normal_(param, 1.0 if "LayerNorm.weight" in name else 0.0, 0.1)
    attn, out = bert.attention, bert.output
    modules = [attn.self.query, attn.self.key, attn.self.value, attn.output.dense]
    modules += [attn.output.LayerNorm, bert.intermediate.dense, out.dense, out.LayerNorm]
    layer = DeepSpeedTransformerLayer(
        _config(pre_layer_norm=False),
        [m.weight.detach().clone() for m in modules],
        [m.bias.detach().clone() for m in modules],
    ).eval()
    x, mask = torch.randn(3, 10, HIDDEN), _bert_mask(3, 10)
    with torch.no_grad():
        want = bert(x, attention_mask=mask)
        want = want[0] if isinstance(want, tuple) else want
        torch.testing.assert_close(layer(x, mask), want, rtol=1e-5, atol=1e-5)
