"""Rank side of ``test_save_autotp.py``: an engine trained with ``tensor_parallel.autotp_size``
2 at each ZeRO stage hands out and writes whole 16-bit weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import shardspeed
from tests.runtime.tensor_parallel.autotp_ranks import MICRO, OPT, batches, full_parameters
from tests.runtime.tensor_parallel.autotp_ranks import tiny_model as autotp_tiny_model


def _config(stage: int, gather: bool, hf_batch: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": dict(OPT)},
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": gather,
        },
        "tensor_parallel": {"autotp_size": 2},
    }
    if hf_batch:  # as the HF Trainer fills "auto": every rank counted, tensor-parallel peers too
        config["train_batch_size"] = MICRO * 1 * 2
    return config


def _trained_engine(kind: str, stage: int, gather: bool, hf_batch: bool) -> Any:
    model = autotp_tiny_model(kind)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, gather, hf_batch)
    )
    rows = batches(1, MICRO)[0]
    engine.backward(engine(input_ids=rows, labels=rows).loss)
    engine.step()
    return engine


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference over ``want``'s keys (inf when a key is missing or a shape
    differs)."""
    worst = 0.0
    for name, tensor in want.items():
        if name not in got or got[name].shape != tensor.shape:
            return float("inf")
        worst = max(worst, float((got[name].float() - tensor.float()).abs().max()))
    return worst


def save_cases(folder: str, cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Each (model, ZeRO stage): the consolidated dicts and ``save_16bit_model``'s file against
    the engine's parameters gathered whole; then a ZeRO-3 engine not allowed to gather."""
    rank = torch.distributed.get_rank()
    out = []
    for kind, stage in cases:
        engine = _trained_engine(kind, stage, gather=True, hf_batch=stage == 1)
        whole = full_parameters(engine)
        zero3 = engine._zero3_consolidated_16bit_state_dict()
        consolidated = engine._consolidated_16bit_state_dict()
        path = Path(folder) / f"{kind}-{stage}"
        saved = engine.save_16bit_model(str(path), "weights.bin")
        result = {
            "case": (kind, stage),
            "train_batch_size": engine.train_batch_size(),
            "zero3_dict": _compare(zero3, whole),
            "consolidated": _compare(consolidated, whole),
            "saved": saved,
            "tied_kept": kind != "qwen2"
            or consolidated["lm_head.weight"] is consolidated["model.embed_tokens.weight"],
        }
        if rank == 0:
            result["file"] = _compare(torch.load(path / "weights.bin"), whole)
            result["file_keys"] = sorted(torch.load(path / "weights.bin"))
            result["model_keys"] = sorted(engine.module.state_dict())
        out.append(result)
        engine.destroy()
    engine = _trained_engine("llama", 3, gather=False, hf_batch=False)
    last = {"not_gathered": engine.save_16bit_model(str(Path(folder) / "none"), "w.bin")}
    engine.destroy()
    # nothing split (no AutoTP, ZeRO-1): DeepSpeed's ValueError, which Accelerate relies on
    model = autotp_tiny_model("llama")
    config = {**_config(1, True, False), "tensor_parallel": {"autotp_size": 1}}
    engine, *_ = shardspeed.initialize(model=model, config=config)
    try:
        engine._consolidated_16bit_state_dict()
    except ValueError as error:
        last["unsplit_error"] = str(error)
    engine.destroy()
    out.append(last)
    return out
