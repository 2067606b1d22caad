"""Rank-side code of the hybrid-engine tests (run on every rank of a ``dist_pool``), and the
pieces the benchmark companion shares: a tiny Hugging Face Llama built from a config, and the
ZeRO-3 hybrid-engine config."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

import shardspeed
from shardspeed import comm


def tiny_llama(hidden: int = 32, layers: int = 2, vocab: int = 64, seed: int = 0) -> nn.Module:
    """A Llama built from a config (nothing downloaded), seeded; no end-of-sequence token, so
    every call generates exactly the tokens it asks for on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hybrid_config(stage: int = 3, **hybrid: Any) -> dict[str, Any]:
    """ZeRO ``stage`` with the hybrid engine on (``hybrid``: more ``hybrid_engine`` keys)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 128, **hybrid},
    }


def prompts(batch: int = 2, length: int = 5, vocab: int = 64) -> torch.Tensor:
    """This rank's prompts (different on every rank: no rank waits for another's tokens)."""
    generator = torch.Generator().manual_seed(100 + comm.get_rank())
    return torch.randint(1, vocab, (batch, length), generator=generator)


def gathers() -> int:
    """All-gathers counted by the byte counter since its last reset."""
    volume = comm.get_comm_volume()
    return sum(int(v["count"]) for op, v in volume.items() if "gather" in op)


def generate_case(new_tokens: list[int], stage: int = 3, **hybrid: Any) -> dict[str, Any]:
    """Tokens of the hybrid engine at ZeRO-3 and of the unpartitioned model (this process,
    Hugging Face's greedy generate), and all-gathers per call: of the hybrid engine and of the
    training engine's hooks generating, for each count of new tokens."""
    model = tiny_llama()
    reference = copy.deepcopy(model).eval()
    engine, *_ = shardspeed.initialize(model=model, config=hybrid_config(stage, **hybrid))
    ids = prompts()
    out: dict[str, Any] = {"kind": type(engine).__name__, "equal": [], "hybrid": [], "hooks": []}
    for new in new_tokens:
        expected = reference.generate(ids, max_new_tokens=new, do_sample=False)
        comm.reset_comm_volume()
        got = engine.generate(ids, max_new_tokens=new, do_sample=False)
        out["hybrid"].append(gathers())
        out["equal"].append(bool(torch.equal(got, expected)))
        comm.reset_comm_volume()
        engine.module.eval()
        with torch.no_grad():
            hooked = engine.module.generate(ids, max_new_tokens=new, do_sample=False)
        engine.module.train()
        out["hooks"].append(gathers())
        out["hooks_equal"] = bool(torch.equal(hooked, expected))
    out["fused"] = engine.last_generate_fused
    out["training_mode"] = engine.module.training
    out["units"] = sum(1 for m in model.modules() if any(True for _ in m.parameters(False)))
    engine.destroy()
    return out


def _loss(engine: Any, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + comm.get_rank())
    ids = torch.randint(1, 64, (2, 8), generator=generator)
    return engine(input_ids=ids, labels=ids).loss


def training_case(steps: int = 3) -> dict[str, Any]:
    """Losses of two ZeRO-3 engines from the same weights and batches: one generates (greedy
    and sampled) between its steps, the other never does; and the generated tokens' equality
    to the reference after training changed the weights."""
    losses: dict[str, list[float]] = {"generating": [], "plain": []}
    after_training_equal = []
    for kind in losses:
        model = tiny_llama()
        engine, *_ = shardspeed.initialize(model=model, config=hybrid_config())
        for step in range(steps):
            if kind == "generating":
                engine.generate(prompts(), max_new_tokens=6, do_sample=False)
                engine.generate(prompts(), max_new_tokens=4, do_sample=True, top_k=5)
            loss = _loss(engine, step)
            engine.backward(loss)
            engine.step()
            losses[kind].append(float(loss))
        if kind == "generating":
            with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
                trained = copy.deepcopy(engine.module).eval()
            ids = prompts()
            expected = trained.generate(ids, max_new_tokens=6, do_sample=False)
            got = engine.generate(ids, max_new_tokens=6, do_sample=False)
            after_training_equal.append(bool(torch.equal(got, expected)))
        engine.destroy()
    return {**losses, "after_training_equal": after_training_equal}


def timing_case(new_tokens: int, hidden: int, layers: int, repeats: int = 2) -> dict[str, Any]:
    """Seconds to generate ``new_tokens`` through the hybrid engine and through the ZeRO-3
    training engine's hooks (best of ``repeats``), and their tokens' equality."""
    model = tiny_llama(hidden=hidden, layers=layers, vocab=512)
    engine, *_ = shardspeed.initialize(model=model, config=hybrid_config())
    ids = prompts(batch=2, length=8, vocab=512)
    engine.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up of both paths
    engine.module.eval()
    with torch.no_grad():
        engine.module.generate(ids, max_new_tokens=2, do_sample=False)
    best = {"hybrid": float("inf"), "hooks": float("inf")}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        outputs["hybrid"] = engine.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        best["hybrid"] = min(best["hybrid"], time.perf_counter() - start)
        comm.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            outputs["hooks"] = engine.module.generate(
                ids, max_new_tokens=new_tokens, do_sample=False
            )
        best["hooks"] = min(best["hooks"], time.perf_counter() - start)
    engine.module.train()
    equal = bool(torch.equal(outputs["hybrid"], outputs["hooks"]))
    engine.destroy()
    return {**best, "equal": equal, "params": sum(p.numel() for p in model.parameters())}


def lora_case() -> dict[str, Any]:
    """A PEFT LoRA model (adapters made non-zero) at ZeRO-3: the hybrid engine's tokens equal
    those of the merged model in one process, and its trained weights stay unmerged."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    merged = copy.deepcopy(model).merge_and_unload().eval()
    base_before = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    base_before = base_before.detach().clone()
    engine, *_ = shardspeed.initialize(model=model, config=hybrid_config())
    ids = prompts()
    expected = merged.generate(ids, max_new_tokens=8, do_sample=False)
    got = engine.generate(ids, max_new_tokens=8, do_sample=False)
    layer = engine.module.get_base_model().model.layers[0].self_attn.q_proj
    with shardspeed.zero.GatheredParameters([layer.base_layer.weight]):
        unchanged = bool(torch.equal(layer.base_layer.weight, base_before))
    out = {
        "equal": bool(torch.equal(got, expected)),
        "fused": engine.last_generate_fused,
        "lora_layers": engine.lora_layers,
        "base_unchanged": unchanged,
        "differs_from_base": not torch.equal(
            expected, tiny_llama().eval().generate(ids, max_new_tokens=8, do_sample=False)
        ),
    }
    engine.destroy()
    return out


def rollout_case() -> dict[str, Any]:
    """``HybridEngineRollout`` over a ZeRO-3 hybrid engine: greedy (2 samples per prompt) and
    sampled rollouts."""
    from types import SimpleNamespace

    from shardspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig

    model = tiny_llama()
    reference = copy.deepcopy(model).eval()
    engine, *_ = shardspeed.initialize(model=model, config=hybrid_config())
    ids = prompts(batch=2, length=4)
    rollout = HybridEngineRollout(engine, SimpleNamespace(pad_token_id=0, eos_token_id=None))
    request = RolloutRequest(ids, torch.ones_like(ids))
    greedy = rollout.generate(request, SamplingConfig(6, temperature=0.0, n_samples_per_prompt=2))
    expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    sampled = rollout.generate(request, SamplingConfig(5, temperature=1.0, top_k=8))
    rollout.sync_weights_from_student(0)
    out = {
        "shape": tuple(greedy.input_ids.shape),
        "equal": bool(torch.equal(greedy.input_ids, expected.repeat_interleave(2, dim=0))),
        "starts": greedy.response_start_idx.tolist(),
        "mask_all": bool(greedy.attention_mask.all()),
        "sampled_shape": tuple(sampled.input_ids.shape),
    }
    engine.destroy()
    return out


def unwrap_case(new: int = 8) -> dict[str, Any]:
    """``runtime.zero.unwrap_model_for_generation`` on a plain ZeRO-3 training engine: tokens
    against the whole model in this process, all-gathers inside the block, and a training step
    after it equal to one of an engine that never generated."""
    from shardspeed.runtime.zero import unwrap_model_for_generation

    config = hybrid_config()
    del config["hybrid_engine"]
    out: dict[str, Any] = {}
    losses = []
    for generate in (True, False):
        model = tiny_llama()
        reference = copy.deepcopy(model).eval()
        engine, *_ = shardspeed.initialize(model=model, config=config)
        if generate:
            ids = prompts()
            comm.reset_comm_volume()
            with unwrap_model_for_generation(engine) as unwrapped:
                gathered = gathers()
                got = unwrapped.generate(ids, max_new_tokens=new, do_sample=False)
                out["gathers_in_generate"] = gathers() - gathered
            out["gathers"] = gathered
            out["equal"] = bool(torch.equal(got, reference.generate(ids, max_new_tokens=new)))
            out["training_mode"] = engine.module.training
        loss = _loss(engine, 0)
        engine.backward(loss)
        engine.step()
        losses.append(float(_loss(engine, 1)))
        engine.destroy()
    out["losses_equal"] = losses[0] == losses[1]
    return out
