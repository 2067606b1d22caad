"""Rank functions of the ZeRO-Inference tests: a Hugging Face model run forward through
``shardspeed.initialize`` at ZeRO stage 3 with its parameters offloaded, without an optimizer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

import shardspeed
from shardspeed import comm
from tests.inference import models


def zero_inference(device: str, folder: str | None = None) -> dict[str, Any]:
    """The tiny Llama at stage 3 with ``offload_param`` to ``device`` vs the plain model: max
    logit error, greedy tokens equal, and where the parameters are after the forward (module
    parameters released, shard bytes held in memory and in swap files)."""
    reference = models.build("llama")
    ids = models.prompt()
    want_logits = reference(ids).logits
    want_tokens = models.greedy(reference, ids)
    offload: dict[str, Any] = {"device": device}
    if folder is not None:
        offload["nvme_path"] = folder
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": offload,
        },
    }
    engine, optimizer, *_ = shardspeed.initialize(model=copy.deepcopy(reference), config=config)
    engine.eval()
    with torch.no_grad():
        got_logits = engine(ids).logits
        got_tokens = models.greedy(engine.module, ids)
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    units = [unit for unit in engine.strategy.sharding.units if not unit.persistent]
    shards = [flat.shard for unit in units for flat in unit.flats]
    files = sorted(Path(folder).glob(f"swap_rank{comm.get_rank()}/*")) if folder else []
    result = {
        "optimizer": optimizer,
        "max_err": (got_logits - want_logits).abs().max().item(),
        "tokens_equal": torch.equal(got_tokens, want_tokens),
        "param_bytes_on_module": sum(
            p.untyped_storage().nbytes() for p in engine.module.parameters()
        ),
        "shard_devices": sorted({str(s.device) for s in shards}),
        "shard_bytes_in_memory": sum(s.untyped_storage().nbytes() for s in shards),
        "shard_bytes": sum(
            flat.chunk_numel * flat.full.element_size() for unit in units for flat in unit.flats
        ),
        "full_bytes": full,
        "swap_files": len(files),
        "swap_bytes": sum(f.stat().st_size for f in files),
    }
    engine.destroy()
    return result
