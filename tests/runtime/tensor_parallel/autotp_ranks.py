"""Rank side of the AutoTP training tests: small Hugging Face models split by
``tensor_parallel.autotp_size``, trained with ZeRO over the data-parallel ranks, compared step
by step with the whole model trained in one process on the same global batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardspeed
from shardspeed.comm.parallel_topology import current_topology
from shardspeed.runtime.tensor_parallel.gather import whole_state_dict
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.zero import GatheredParameters

VOCAB, SEQ, MICRO = 64, 8, 2
# Adam divides by sqrt(v) + eps: with a tiny eps, float noise in gradients of ~1e-9 (row-parallel
# partial sums add in another order) becomes 1e-5 weight changes; eps 1e-3 keeps these tests
# about the split, not about Adam's conditioning.
OPT = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}


def tiny_model(kind: str, seed: int = 0) -> nn.Module:
    """A two-layer Llama (4 query heads, 2 key/value heads, untied head) or Qwen2 (biased
    q/k/v, tied head), built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    if kind == "qwen3":  # q_norm / k_norm: replicated, gradients summed over the group
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, tie_word_embeddings=False))
    if kind == "phi3":  # fused qkv_proj (q, kv, kv wide) and gate_up_proj
        from transformers import Phi3Config, Phi3ForCausalLM

        return Phi3ForCausalLM(Phi3Config(**common, pad_token_id=0, tie_word_embeddings=False))
    if kind == "gpt2":  # no Hugging Face plan: the structural rules; Conv1D; dropout
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=32,
                n_layer=2,
                n_head=4,
                attn_pdrop=0.0,
                resid_pdrop=0.1,
                embd_pdrop=0.1,
            )
        )
    return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))


def batches(steps: int, rows: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, rows, SEQ), generator=gen)


def _config(tp: int, stage: int, gas: int, clip: float, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": dict(OPT)},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        **extra,
    }


def full_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (ZeRO-3 gathered, tensor-parallel pieces assembled)."""
    model = engine.module
    with GatheredParameters(list(model.parameters())):
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
    return whole_state_dict(model, local, CommGroup.of(current_topology().group("tp")))


def train_and_compare(
    kind: str,
    tp: int,
    stage: int,
    steps: int = 10,
    gas: int = 1,
    clip: float = 1.0,
    extra: dict[str, Any] | None = None,
    checkpointing: bool = False,
    reseed: bool = False,
) -> dict[str, Any]:
    """``steps`` optimizer steps at ``tp`` x (world / tp) ranks and ZeRO ``stage`` against the
    whole model in this process: the losses and the whole parameters after every step.

    ``extra``: more config (precision, offload); ``checkpointing``: Hugging Face's gradient
    checkpointing on the split model; ``reseed``: the random state set before each forward, the
    same for both (dropout: the split model must draw the whole model's masks)."""
    world = dist.get_world_size()
    dp = world // tp
    model = tiny_model(kind)
    reference = copy.deepcopy(model)
    if checkpointing:
        model.activation_checkpointing_enable()
    ref_opt = torch.optim.AdamW(reference.parameters(), **OPT)
    config = _config(tp, stage, gas, clip)
    for key, value in (extra or {}).items():
        config[key] = {**config[key], **value} if key in config else value
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    topo = current_topology()
    assert topo.size("tp") == tp and topo.size("dp") == dp
    dp_rank = topo.local_rank("dp")
    data = batches(steps, MICRO * dp * gas)
    worst_loss = worst_param = 0.0
    tp_losses = []
    for step in range(steps):
        rows = data[step]
        losses = []
        for micro in range(gas):
            start = (micro * dp + dp_rank) * MICRO
            mine = rows[start : start + MICRO]
            if reseed:
                torch.manual_seed(1000 + step * gas + micro)
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        tp_losses.append(float(mean))
        dist.all_reduce(mean)
        mean /= world
        ref_opt.zero_grad()
        ref_total = 0.0
        for micro in range(gas):
            chunk = rows[micro * dp * MICRO : (micro + 1) * dp * MICRO]
            if reseed:
                torch.manual_seed(1000 + step * gas + micro)
            ref_loss = reference(input_ids=chunk, labels=chunk).loss / gas
            ref_loss.backward()
            ref_total += float(ref_loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        worst_loss = max(worst_loss, abs(float(mean) - ref_total) / abs(ref_total))
        got = full_parameters(engine)
        for name, want in reference.named_parameters():
            diff = (got[name].float() - want.detach()).abs().max() / want.detach().abs().max()
            worst_param = max(worst_param, float(diff))
    return {
        "loss": worst_loss,
        "param": worst_param,
        "tp_losses": tp_losses,
        **held_bytes(engine.module),
    }


def held_bytes(model: nn.Module) -> dict[str, Any]:
    """Elements of the split parameters: whole, this rank's pieces, and what this rank holds
    (its ZeRO-3 partition of its pieces, else the pieces)."""
    whole = piece = held = 0
    for param in model.parameters():
        layout = getattr(param, "tp_layout", None)
        if layout is None:
            continue
        whole += torch.Size(layout.full_shape).numel()
        piece += torch.Size(layout.local_shape(current_topology().local_rank("tp"))).numel()
        shard = getattr(param, "ds_tensor", None)
        held += shard.numel() if shard is not None else param.numel()
    return {"whole": whole, "piece": piece, "held": held}


def autotp_parity_cases(cases: list[tuple[str, int, int, int]]) -> list[dict[str, Any]]:
    """Every (model, tp, stage, gas) case in this process group, one after another."""
    return [train_and_compare(kind, tp, stage, gas=gas) for kind, tp, stage, gas in cases]


def autotp_composition_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every ``train_and_compare`` keyword set in ``cases``, one after another."""
    return [train_and_compare(**case) for case in cases]


def autotp_surface() -> dict[str, Any]:
    """DeepSpeed's AutoTP group queries at TP 2 x DP 2, the first-forward input check (inputs
    that differ across a tensor-parallel group are refused on every rank; equal ones pass)."""
    from shardspeed.runtime.tensor_parallel.input_check import TensorParallelInputError
    from shardspeed.utils import groups

    out: dict[str, Any] = {}
    model = tiny_model("llama")
    engine, *_ = shardspeed.initialize(model=model, config=_config(2, 0, 1, 1.0))
    out["groups"] = (
        groups.get_tensor_model_parallel_world_size(),
        groups.get_tensor_model_parallel_rank(),
        groups.get_tensor_model_parallel_src_rank(),
        groups.get_data_parallel_world_size(),
        groups.get_data_parallel_rank(),
        engine.dp_world_size,
    )
    rows = batches(1, MICRO)[0] + 0
    mine = (rows + dist.get_rank()) % VOCAB  # a loader sharded by global rank
    try:
        engine(input_ids=mine, labels=mine)
        out["mismatch"] = None
    except TensorParallelInputError as error:
        out["mismatch"] = str(error)
    engine, *_ = shardspeed.initialize(model=tiny_model("llama"), config=_config(2, 0, 1, 1.0))
    mine = (rows + current_topology().local_rank("dp")) % VOCAB  # by data-parallel rank
    out["same"] = float(engine(input_ids=mine, labels=mine).loss)
    # one training step's tensor-parallel traffic: 2 all-reduces forward and 2 backward per
    # layer (q/k/v and gate/up share one input copy each), the embedding's forward one, the
    # head input's backward one, one all-gather of the logits; no copy outlives the forward
    from shardspeed import comm
    from shardspeed.runtime.tensor_parallel.layers import SHARED_COPIES

    comm.reset_comm_volume()
    loss = engine(input_ids=mine, labels=mine).loss
    engine.backward(loss)
    volume = comm.get_comm_volume()
    out["traffic"] = {op: v["count"] for op, v in volume.items()}
    out["copies_left"] = len(SHARED_COPIES.entries)
    # every rank built its model from another seed: each tensor-parallel group splits its rank
    # 0's, and the data-parallel broadcast makes them all global rank 0's
    engine, *_ = shardspeed.initialize(
        model=tiny_model("qwen2", seed=dist.get_rank()), config=_config(2, 3, 1, 1.0)
    )
    got = full_parameters(engine)
    want = dict(tiny_model("qwen2", seed=0).named_parameters())
    out["agreed"] = max(float((got[n] - p.detach()).abs().max()) for n, p in want.items())
    return out
