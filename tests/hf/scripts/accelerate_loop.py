"""An Accelerate training loop on a tiny Llama: plain (DDP on CPU), then ``DeepSpeedPlugin``
(shardspeed) at ZeRO 2 and 3, gradient accumulation through ``accelerator.accumulate``.

Usage: ``<launcher> accelerate_loop.py OUT``. Rank 0 writes ``OUT/accelerate.json``: per case the
mean loss of every micro-batch across ranks, the trained model's score, and under ZeRO-3 the
bytes each rank held after ``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_common import RandomTokens, arguments, forget_run, score, shard_bytes, start, write_json
from torch.utils.data import DataLoader

from shardspeed import comm

GRAD_ACCUM = 2
MICRO_BATCH = 2


def accelerator_for(stage: int | None) -> Any:
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    if stage is None:
        return Accelerator(cpu=True, gradient_accumulation_steps=GRAD_ACCUM)
    plugin = DeepSpeedPlugin(
        zero_stage=stage,
        gradient_accumulation_steps=GRAD_ACCUM,
        gradient_clipping=1.0,
        zero3_init_flag=stage == 3,
        zero3_save_16bit_model=stage == 3,
    )
    # Accelerate picks no backend for DeepSpeed without a GPU: name gloo (see hf_common)
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(
        deepspeed_plugin=plugin, gradient_accumulation_steps=GRAD_ACCUM, kwargs_handlers=handlers
    )


def run_case(stage: int | None, init_dir: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    accelerator = accelerator_for(stage)
    model = LlamaForCausalLM.from_pretrained(str(init_dir))
    loaded = shard_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = DataLoader(RandomTokens(), batch_size=MICRO_BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    micro_losses: list[float] = []
    steps = 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                steps += 1
            optimizer.step()
            optimizer.zero_grad()
        micro_losses.append(float(accelerator.gather(loss.detach()).mean()))
    result = {
        "stage": stage,
        "distributed_type": str(accelerator.distributed_type),
        "engine": type(model).__name__,
        "optimizer_steps": steps,
        "micro_losses": micro_losses,
        "score": score(model),
        "loaded_bytes": loaded,
    }
    accelerator.free_memory()
    del model, optimizer, loader, accelerator
    forget_run()
    return result


def main() -> None:
    opts = arguments()
    init_dir = start(opts.out)
    rank = comm.get_rank()
    results = {
        name: run_case(stage, init_dir) for name, stage in (("plain", None), ("z2", 2), ("z3", 3))
    }
    gathered = [None] * comm.get_world_size()
    comm.all_gather_object(gathered, {k: v["loaded_bytes"] for k, v in results.items()})
    if rank == 0:
        for name in results:
            results[name]["loaded_bytes"] = [g[name] for g in gathered]  # type: ignore[index]
        write_json(opts.out / "accelerate.json", results)


if __name__ == "__main__":
    main()
