"""An Accelerate training loop on a tiny Llama: plain (DDP on CPU), then ``DeepSpeedPlugin``
(shardspeed) at ZeRO 2 and 3, gradient accumulation through ``accelerator.accumulate``.

Usage: ``<launcher> accelerate_loop.py OUT``. Rank 0 writes ``OUT/accelerate.json``: per case the
mean loss of every micro-batch across ranks, the trained model's score, the score of a fresh
model after ``accelerator.load_state`` of the trained one's ``save_state``, and the bytes each
rank held after ``from_pretrained``.
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


def prepared(stage: int | None, init_dir: Path) -> tuple[Any, Any, Any, Any, dict[str, int]]:
    """A fresh accelerator, and the saved model, AdamW and the data loader prepared by it."""
    from transformers import LlamaForCausalLM

    accelerator = accelerator_for(stage)
    model = LlamaForCausalLM.from_pretrained(str(init_dir))
    loaded = shard_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = DataLoader(RandomTokens(), batch_size=MICRO_BATCH, shuffle=False)
    return accelerator, *accelerator.prepare(model, optimizer, loader), loaded


def run_case(stage: int | None, init_dir: Path, state_dir: Path) -> dict[str, Any]:
    accelerator, model, optimizer, loader, loaded = prepared(stage, init_dir)
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
    accelerator.save_state(str(state_dir))
    accelerator.free_memory()
    del model, optimizer, loader, accelerator
    forget_run()
    # a fresh (untrained) model takes the trained one's weights from save_state's folder
    accelerator, model, *_ = prepared(stage, init_dir)
    accelerator.load_state(str(state_dir))
    result["loaded_state_score"] = score(model)
    accelerator.free_memory()
    del model, accelerator
    forget_run()
    return result


def main() -> None:
    opts = arguments()
    init_dir = start(opts.out)
    rank = comm.get_rank()
    cases = (("plain", None), ("z2", 2), ("z3", 3))
    results = {name: run_case(stage, init_dir, opts.out / f"state-{name}") for name, stage in cases}
    gathered = [None] * comm.get_world_size()
    comm.all_gather_object(gathered, {k: v["loaded_bytes"] for k, v in results.items()})
    if rank == 0:
        for name in results:
            results[name]["loaded_bytes"] = [g[name] for g in gathered]  # type: ignore[index]
        write_json(opts.out / "accelerate.json", results)


if __name__ == "__main__":
    main()
