"""Rank-side code of the AutoEP tests: small Hugging Face MoE models built from configs, made
expert-parallel by AutoEP, against the unmodified model on the same ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

import shardspeed
from shardspeed.config.expert_parallel import ExpertParallelConfig
from shardspeed.moe.autoep import AutoEPMoELayer, apply_autoep
from tests.runtime.parity import assert_close

VOCAB = 64
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.05,
    "tie_word_embeddings": False,
}
#: DeepSeek-V2/V3: multi-head latent attention sizes, 2 expert groups of which each token uses 1
_DEEPSEEK = {
    "n_routed_experts": 4,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 8,
    "intermediate_size": 16,
    "n_group": 2,
    "topk_group": 1,
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "intermediate_size": 8},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 8, "intermediate_size": 16, "head_dim": 8},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**_DEEPSEEK, "first_k_dense_replace": 1},  # layer 0 dense, layer 1 MoE
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {**_DEEPSEEK, "n_shared_experts": 1, "topk_method": "group_limited_greedy"},
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {
            "num_experts": 4,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8,
            "head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
    ),
}
PRESET = {"qwen2_moe": "qwen3_moe"}


def build(family: str, seed: int = 0, **extra: Any) -> nn.Module:
    """A small model of ``family`` (fp32, eager attention), seeded."""
    config_cls, model_cls, sizes = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **sizes, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).float()


def section(family: str, ep_size: int = 2, **keys: Any) -> dict[str, Any]:
    return {
        "enabled": True,
        "autoep_size": ep_size,
        "preset_model": PRESET.get(family, family),
        **keys,
    }


def _local_slices(model: nn.Module) -> dict[str, slice]:
    """Name of every local expert tensor -> its rows in the full fused tensor."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, AutoEPMoELayer):
            experts = module.local_experts
            rows = slice(experts.first_expert, experts.first_expert + experts.num_experts)
            for pname, _ in experts.named_parameters():
                out[f"{name}.{module.experts_name}.{pname}"] = rows
    return out


def _tokens(rank: int, step: int, batch: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


def forward_parity(family: str) -> dict[str, float]:
    """Outputs, router logits, aux loss, input and parameter gradients of the AutoEP model equal
    the unmodified model's on this rank's tokens (ranks hold different numbers of tokens);
    an expert's gradient equals the sum over the ranks of the reference's. Returns max errors."""
    rank = dist.get_rank()
    reference = build(family)
    model = copy.deepcopy(reference)
    replaced = apply_autoep(model, ExpertParallelConfig(**section(family)))
    assert replaced and all(isinstance(model.get_submodule(n), AutoEPMoELayer) for n in replaced)
    ids = _tokens(rank, 0, 2, 5 + 3 * rank)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    ref = reference(input_ids=ids, labels=ids, output_router_logits=True)
    errors = {
        "logits": (out.logits - ref.logits).abs().max().item(),
        "router_logits": max(
            (a - b).abs().max().item()
            for a, b in zip(out.router_logits, ref.router_logits, strict=True)
        ),
    }
    assert len(out.router_logits) == len(ref.router_logits) > 0
    assert_close(out.logits, ref.logits, f"{family} logits", 1e-5, 1e-6)
    if ref.aux_loss is not None:  # DeepSeek-V3 has no router aux loss
        assert_close(out.aux_loss, ref.aux_loss, f"{family} aux loss", 1e-5, 1e-7)
    out.loss.backward()
    ref.loss.backward()
    errors["grads"] = _compare_grads(model, reference, family)
    return errors


def empty_rank_parity() -> float:
    """A rank with no tokens still takes part in the exchange (and its experts serve the other
    rank); outputs and gradients equal the unmodified block's."""
    rank = dist.get_rank()
    reference = build("qwen2_moe").model.layers[0].mlp
    holder = _held(copy.deepcopy(reference))
    apply_autoep(holder, ExpertParallelConfig(**section("qwen2_moe", moe_layer_pattern="mlp")))
    x = torch.randn(1, 7 * rank, 16, generator=torch.Generator().manual_seed(3))
    out, ref = holder.mlp(x), reference(x)
    assert_close(out, ref, "empty-rank output", 1e-5, 1e-6)
    out.sum().backward()
    ref.sum().backward()
    return _compare_grads(holder, _held(reference), "empty-rank")


def _held(block: nn.Module) -> nn.Module:
    holder = nn.Module()
    holder.add_module("mlp", block)
    return holder


def _compare_grads(model: nn.Module, reference: nn.Module, what: str) -> float:
    """Every gradient of ``model`` equals ``reference``'s, an expert slice's equal to the sum
    over the ranks of the reference's rows (an expert learns from every rank's tokens)."""
    slices = _local_slices(model)
    ref_params = dict(reference.named_parameters())
    error = 0.0
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        assert param.grad is not None and expected is not None, name
        if name in slices:
            dist.all_reduce(expected)
            expected = expected[slices[name]]
        assert_close(param.grad, expected, f"{what} {name} grad", 1e-5, 1e-6)
        error = max(error, (param.grad - expected).abs().max().item())
    return error


def training_parity(family: str, stage: int, ep_size: int = 2, steps: int = 10) -> dict[str, Any]:
    """``steps`` steps of the AutoEP model through ``shardspeed.initialize`` against the
    unmodified model trained with plain data parallelism (same seed, same data, clipping):
    losses and parameters (local expert slices against their rows) agree at every step."""
    rank = dist.get_rank()
    reference = build(family)
    model = copy.deepcopy(reference)
    base = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
    }
    engine, *_ = shardspeed.initialize(
        model=model, config={**base, "expert_parallel": section(family)}
    )
    ref_engine, *_ = shardspeed.initialize(model=reference, config=base)
    slices = _local_slices(engine.module)
    assert slices, "AutoEP replaced nothing"
    ref_params = dict(ref_engine.module.named_parameters())
    losses, norms, max_param_error = [], [], 0.0
    for step in range(steps):
        ids = _tokens(rank, step % 2, 2, 6)  # two batches again and again: the loss falls
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref_engine(input_ids=ids, labels=ids).loss
        ref_engine.backward(ref_loss)
        ref_engine.step()
        assert_close(loss.detach(), ref_loss.detach(), f"{family} loss at step {step}", 1e-5, 1e-6)
        norm, ref_norm = engine.get_global_grad_norm(), ref_engine.get_global_grad_norm()
        assert norm is not None and ref_norm is not None
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)  # experts once
        norms.append(ref_norm)
        for name, param in engine.module.named_parameters():
            expected = ref_params[name].detach()
            if name in slices:
                expected = expected[slices[name]]
            # atol 1e-5: experts' gradients are summed in another order than the dense model's
            # (all-to-all then per-expert), and after 10 Adam steps at lr 1e-2 that fp32
            # reduction-order noise reaches ~2e-6 on near-zero weights
            what = f"{family} {name} at step {step}"
            assert_close(param.detach(), expected, what, 1e-5, 1e-5)
            max_param_error = max(max_param_error, (param.detach() - expected).abs().max().item())
        losses.append(loss.item())
    engine.destroy()
    ref_engine.destroy()
    assert max(norms) > base["gradient_clipping"], norms  # clipping took part
    return {"losses": losses, "max_param_error": max_param_error}


class _LinearRouterBlock(nn.Module):
    """An older-style MoE block: an ``nn.Linear`` router returning logits, fused experts, and a
    ``(output, router_logits)`` result; its forward is the routing rule written out."""

    def __init__(self, sigmoid_groups: bool) -> None:
        super().__init__()
        config = transformers.MixtralConfig(
            hidden_size=16, intermediate_size=8, num_local_experts=4
        )
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
        nn.init.normal_(self.experts.gate_up_proj, std=0.2)
        nn.init.normal_(self.experts.down_proj, std=0.2)
        self.sigmoid_groups = sigmoid_groups

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, 16)
        logits = self.router(flat)
        if self.sigmoid_groups:  # sigmoid scores, best of 2 groups, renormalised, scaled by 2
            scores = logits.sigmoid()
            best_group = scores.view(-1, 2, 2).amax(-1).argmax(-1, keepdim=True)
            in_group = torch.arange(4).view(1, 4) // 2 == best_group
            indices = scores.masked_fill(~in_group, float("-inf")).topk(2, dim=-1).indices
            weights = scores.gather(1, indices)
            weights = 2.0 * weights / weights.sum(-1, keepdim=True)
        else:  # softmax, top-2, not renormalised
            weights, indices = torch.softmax(logits, dim=-1).topk(2, dim=-1)
        return self.experts(flat, indices, weights).reshape(x.shape), logits


class _LinearRouterModel(nn.Module):
    def __init__(self, sigmoid_groups: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_LinearRouterBlock(sigmoid_groups) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        all_logits = []
        for block in self.blocks:
            out, logits = block(x)
            x = x + out
            all_logits.append(logits)
        return x, all_logits


def custom_parity(sigmoid_groups: bool) -> dict[str, float]:
    """A custom model (no preset) detected by the override keys, routed by the keys' rule,
    equals its own forward: outputs, router logits and gradients."""
    rank = dist.get_rank()
    reference = _LinearRouterModel(sigmoid_groups)
    model = copy.deepcopy(reference)
    keys: dict[str, Any] = {"route_norm": False}
    if sigmoid_groups:
        keys = {"score_func": "sigmoid", "num_expert_groups": 2, "num_limited_groups": 1,
                "routed_scaling_factor": 2.0}  # fmt: skip
    section = ExpertParallelConfig(
        enabled=True,
        autoep_size=2,
        moe_layer_pattern=r"blocks\.\d+",
        router_pattern="router",
        expert_pattern="experts",
        top_k=2,
        **keys,
    )
    assert apply_autoep(model, section) == ["blocks.0", "blocks.1"]
    x = torch.randn(3 + 2 * rank, 16, generator=torch.Generator().manual_seed(rank))
    out, logits = model(x)
    ref_out, ref_logits = reference(x)
    assert_close(out, ref_out, "custom output", 1e-5, 1e-6)
    for got, expected in zip(logits, ref_logits, strict=True):
        assert_close(got, expected, "custom router logits", 1e-5, 1e-6)
    out.square().mean().backward()
    ref_out.square().mean().backward()
    grads = _compare_grads(model, reference, "custom")
    return {"output": (out - ref_out).abs().max().item(), "grads": grads}


class _TensorParallelMpu:
    """An mpu reporting two tensor-parallel ranks (only what the refusal reads)."""

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_data_parallel_group(self) -> Any:
        return None


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "<no error>"


def _initialize(zero: int = 2, **sections: Any) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": zero},
        "expert_parallel": section("mixtral"),
        **sections,
    }
    return shardspeed.initialize(model=build("mixtral"), config=config)


def _apply(model: nn.Module | None = None, mpu: Any = None, **keys: Any) -> Any:
    keys = {**section("mixtral"), **keys}
    return apply_autoep(model or build("mixtral"), ExpertParallelConfig(**keys), mpu=mpu)


def refusals() -> dict[str, str]:
    """The message of every refused combination (a refusal changes nothing)."""
    return {
        "autotp": _error(lambda: _initialize(tensor_parallel={"autotp_size": 2})),
        "mpu_tp": _error(lambda: _apply(mpu=_TensorParallelMpu())),
        "deepseek_lb": _error(lambda: _apply(preset_model="deepseek_v3", load_balance_coeff=1e-3)),
        "world": _error(lambda: _apply(autoep_size=4)),
        "experts": _error(lambda: _apply(build("mixtral", num_local_experts=3))),
        "preset": _error(lambda: _apply(preset_model="llama4")),
        "routing_key": _error(lambda: _apply(score_func="sigmoid")),
    }
