"""Rank-side code of the hybrid engine's tensor-parallel generation tests
(``hybrid_engine.inference_tp_size=2`` on a ``dist_pool`` of 2 ranks: one group of two)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import shardspeed
from shardspeed import comm
from tests.runtime.hybrid_engine.ranks import _loss, hybrid_config, prompts, tiny_llama


def tp_generate_case(shapes: list[list[tuple[int, int]]], new: int = 8) -> dict[str, Any]:
    """For each call, ``shapes[call][rank]`` = (batch, prompt length) of that rank's prompts:
    whether the tokens this rank gets equal the unpartitioned model's greedy tokens for its own
    prompts; and the shapes of the split view's projections against the trained model's."""
    model = tiny_llama()
    reference = copy.deepcopy(model).eval()
    engine, *_ = shardspeed.initialize(
        model=model, config=hybrid_config(inference_tp_size=2, max_out_tokens=64)
    )
    out: dict[str, Any] = {"equal": [], "tp": [], "shapes": []}
    for call in shapes:
        batch, length = call[comm.get_rank()]
        ids = prompts(batch, length)
        expected = reference.generate(ids, max_new_tokens=new, do_sample=False)
        got = engine.generate(ids, max_new_tokens=new, do_sample=False)
        out["shapes"].append(tuple(got.shape))
        out["equal"].append(bool(torch.equal(got, expected)))
        out["tp"].append(engine.last_generate_tp)
    view: Any = engine.last_tp_view
    layer = view.model.layers[0]
    out["view_q"] = tuple(layer.self_attn.q_proj.weight.shape)
    out["view_gate"] = tuple(layer.mlp.gate_proj.weight.shape)
    trained = engine.module.model.layers[0].self_attn.q_proj
    with shardspeed.zero.GatheredParameters([trained.weight]):
        out["trained_q"] = tuple(trained.weight.shape)
    out["trained_is_linear"] = type(trained) is torch.nn.Linear
    out["training_mode"] = engine.module.training
    out["tp_size"] = engine.inference_tp.size if engine.inference_tp is not None else 1
    engine.destroy()
    return out


def tp_training_case(steps: int = 3) -> dict[str, Any]:
    """Losses of two ZeRO-3 engines from the same weights and batches: one generates with
    inference TP (greedy, and sampled: the whole-model path) between its steps, the other never
    does; then the TP tokens against the trained model gathered into one process."""
    losses: dict[str, list[float]] = {"generating": [], "plain": []}
    out: dict[str, Any] = {}
    for kind in losses:
        model = tiny_llama()
        engine, *_ = shardspeed.initialize(model=model, config=hybrid_config(inference_tp_size=2))
        for step in range(steps):
            if kind == "generating":
                engine.generate(prompts(), max_new_tokens=6, do_sample=False)
                out["greedy_tp"] = engine.last_generate_tp
                sampled = engine.generate(prompts(), max_new_tokens=4, do_sample=True, top_k=5)
                out["sampled_tp"] = engine.last_generate_tp
                out["sampled_shape"] = tuple(sampled.shape)
            loss = _loss(engine, step)
            engine.backward(loss)
            engine.step()
            losses[kind].append(float(loss))
        if kind == "generating":
            with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
                trained = copy.deepcopy(engine.module).eval()
            ids = prompts(length=3 + 2 * comm.get_rank())
            expected = trained.generate(ids, max_new_tokens=6, do_sample=False)
            got = engine.generate(ids, max_new_tokens=6, do_sample=False)
            out["after_training_equal"] = bool(torch.equal(got, expected))
        engine.destroy()
    return {**losses, **out}


def tp_size_error_case(tp_size: int) -> str:
    """The error ``initialize`` raises for an ``inference_tp_size`` that does not divide the
    world ("" when none)."""
    try:
        shardspeed.initialize(model=tiny_llama(), config=hybrid_config(inference_tp_size=tp_size))
    except ValueError as error:
        assert isinstance(error, AssertionError)  # DeepSpeed-style callers catch either
        return str(error)
    return ""
