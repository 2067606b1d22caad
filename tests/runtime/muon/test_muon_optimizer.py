"""MuonWithAuxAdam in one process: torch.optim.Muon's and AdamW's arithmetic, DeepSpeed's tagging
rule on a Hugging Face Llama, the config's keys and its errors."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardspeed.ops.factory import build_optimizer
from shardspeed.ops.muon import (
    MatrixSpan,
    MuonWithAuxAdam,
    ShardedMatrices,
    muon_param_groups,
    set_optimizer_flags,
)

MUON = SimpleNamespace(optimizer_name="muon")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 7), nn.LayerNorm(7))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return model(torch.randn(5, 12, generator=gen)).pow(2).mean()


@pytest.mark.parametrize("nesterov", [True, False])
def test_equals_torch_muon_plus_adamw(nesterov: bool) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    set_optimizer_flags(MUON, model)
    opt = build_optimizer(
        "Muon",
        model.parameters(),
        {"lr": 1e-3, "muon_lr": 0.05, "momentum": 0.9, "weight_decay": 0.1, "nesterov": nesterov},
    )
    matrices = [p for p in reference.parameters() if p.dim() == 2]
    rest = [p for p in reference.parameters() if p.dim() != 2]
    muon = torch.optim.Muon(matrices, lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=nesterov)
    adamw = torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    for step in range(10):
        for o in (opt, muon, adamw):
            o.zero_grad()
        _loss(model, step).backward()
        _loss(reference, step).backward()
        opt.step()
        muon.step()
        adamw.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert set(opt.state[model[0].weight]) == {"momentum_buffer"}
    assert set(opt.state[model[0].bias]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("placement", ["gather", "round_robin"])
def test_flat_chunk_layout_equals_whole_matrices(placement: str) -> None:
    """One rank holding a flat buffer of two matrices plus padding, described by a layout,
    steps exactly as the whole matrices do (the index arithmetic of the sharded path)."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 4), torch.randn(3, 5)
    grads = [torch.randn(6, 4), torch.randn(3, 5)]
    whole = [nn.Parameter(a.clone()), nn.Parameter(b.clone())]
    flat = nn.Parameter(torch.cat([a.view(-1), b.view(-1), torch.zeros(3)]))
    spans = (MatrixSpan(0, a.shape), MatrixSpan(24, b.shape))

    def identity(t: torch.Tensor) -> torch.Tensor:
        return t

    layout = ShardedMatrices(spans, 0, 1, flat.numel(), identity, identity)
    opt_whole = MuonWithAuxAdam([{"params": whole, "use_muon": True, "weight_decay": 0.1}])
    opt_flat = MuonWithAuxAdam(
        [{"params": [nn.Parameter(a.clone())], "use_muon": True, "weight_decay": 0.1}],
        ns_placement=placement,
    )
    opt_flat.param_groups[0]["params"] = [flat]  # what a ZeRO strategy's rebind does
    opt_flat.bind_matrix_layouts({id(flat): layout})
    for _ in range(3):
        for p, g in zip(whole, grads, strict=True):
            p.grad = g.clone()
        flat.grad = torch.cat([grads[0].view(-1), grads[1].view(-1), torch.zeros(3)])
        opt_whole.step()
        opt_flat.step()
    assert torch.equal(flat[:24].view(6, 4), whole[0])
    assert torch.equal(flat[24:39].view(3, 5), whole[1])


def test_tagging_rule_on_a_small_hf_llama() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    set_optimizer_flags(MUON, model)
    flags = {name: p.use_muon for name, p in model.named_parameters()}
    assert flags["model.embed_tokens.weight"] is False
    assert flags["lm_head.weight"] is False
    assert flags["model.norm.weight"] is False
    assert flags["model.layers.0.input_layernorm.weight"] is False
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj"):
        assert flags[f"model.layers.1.{proj}.weight"] is True
    muon = [n for n, on in flags.items() if on]
    assert len(muon) == 2 * 7  # q, k, v, o, gate, up, down per layer


def test_top_level_names() -> None:
    import shardspeed

    assert shardspeed.MUON_OPTIMIZER == "muon"
    assert shardspeed.set_optimizer_flags is set_optimizer_flags


def test_tagging_only_for_muon() -> None:
    model = _model()
    set_optimizer_flags(SimpleNamespace(optimizer_name="adamw"), model)
    assert not hasattr(model[0].weight, "use_muon")


def test_lrs_and_groups_follow_deepspeed() -> None:
    model = _model()
    set_optimizer_flags(MUON, model)
    model[3].weight.requires_grad_(False)
    groups = muon_param_groups(model.parameters(), {"lr": 0.1, "adam_lr": 0.003, "eps": 1e-8})
    muon, adam = groups
    assert muon["use_muon"] and muon["lr"] == 0.1 and "eps" not in muon
    assert not adam["use_muon"] and adam["lr"] == 0.003 and adam["eps"] == 1e-8
    assert all(p is not model[3].weight for p in adam["params"])  # frozen: stepped by neither
    opt = build_optimizer("MUON", model.parameters(), {"muon_lr": 0.5})
    assert [g["lr"] for g in opt.param_groups] == [0.5, 3e-4]  # DeepSpeed's AdamW default lr


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"freeze_step": 100}, "freeze_step"),
        ({"ns_steps": -1}, "ns_steps"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"ns_steps": 2.5}, "ns_steps"),
        ({"momentum": 1.5}, "momentum"),
        ({"muon_lrr": 0.1}, "muon_lrr"),
        ({"ns_placement": "owner"}, "ns_placement"),
    ],
)
def test_bad_config_names_the_key(params: dict, key: str) -> None:
    model = _model()
    set_optimizer_flags(MUON, model)
    with pytest.raises(ValueError, match=key):
        build_optimizer("Muon", model.parameters(), params)


def test_untagged_parameters_and_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="use_muon"):
        build_optimizer("Muon", _model().parameters(), {})
    model = _model()
    set_optimizer_flags(MUON, model)
    with pytest.raises(TypeError, match="parameter groups"):
        build_optimizer("Muon", [{"params": list(model.parameters())}], {})
    with pytest.raises(ValueError, match="use_muon=False group"):
        MuonWithAuxAdam([{"params": [model[0].bias], "use_muon": True}])


def test_batched_newton_schulz_equals_one_matrix_at_a_time(monkeypatch) -> None:
    from shardspeed.ops.muon import newton_schulz

    gen = torch.Generator().manual_seed(3)
    shapes = [(24, 8), (8, 24), (24, 8), (16, 16), (24, 8), (8, 24), (5, 7)]
    matrices = [torch.randn(*shape, generator=gen) for shape in shapes]
    expected = [newton_schulz.orthogonalize(m) for m in matrices]
    # three (24, 8) in one stack, then split into stacks of two (the element cap)
    for cap in (1 << 26, 2 * 24 * 8):
        monkeypatch.setattr(newton_schulz, "STACK_ELEMENTS", cap)
        got = newton_schulz.orthogonalize_many(matrices)
        assert [tuple(g.shape) for g in got] == shapes
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def test_repeated_shapes_still_equal_torch_muon() -> None:
    # four layers of one shape: the optimizer batches them, torch does them one by one
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)], nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    set_optimizer_flags(MUON, model)
    opt = build_optimizer("Muon", model.parameters(), {"lr": 1e-3, "muon_lr": 0.05})
    matrices = [p for p in reference.parameters() if p.dim() == 2]
    rest = [p for p in reference.parameters() if p.dim() != 2]
    muon = torch.optim.Muon(matrices, lr=0.05, momentum=0.95, weight_decay=0.0)
    adamw = torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(6, 16, generator=gen)
        for net, optimizers in ((model, (opt,)), (reference, (muon, adamw))):
            net(x).pow(2).mean().backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
