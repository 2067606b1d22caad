"""Tensor-parallel training (AutoTP, ``tensor_parallel.autotp_size`` 2) against data
parallelism (ZeRO 0, the DDP equivalent), ZeRO-3 and Hugging Face's own tensor parallelism
(``from_pretrained(tp_plan="auto")``, DTensor) on 2 ranks, in one run.

    python benchmarks/bench_tp.py            # 2 CPU ranks, fp32, ~3 min when quiet

A Llama built from a config (``--hidden``, ``--layers``, ...; random weights saved once with
``save_pretrained`` so every mode loads the same model) trains ``--warmup + --steps`` AdamW steps
on the same global batches of ``--batch`` sequences of ``--seq`` tokens: the tensor-parallel
modes give both ranks the whole batch, the data-parallel ones half each. Each mode runs in fresh
rank processes. Per mode: median step time and tokens/s (global tokens), peak RSS per rank,
the parameter elements each rank holds, the losses (equal across modes up to float
summation order), and for shardspeed's modes the bytes ``shardspeed.comm`` counted per step
(message and bus bytes by collective).

The theory for AutoTP's bus bytes per step (tokens ``T``, hidden ``H``, vocabulary ``V``,
4-byte floats, ring all-reduce moving ``2 (tp-1)/tp`` of a message, all-gather ``(tp-1)/tp``):
per layer two all-reduces of ``T x H`` forward (after the attention and MLP row-parallel
linears) and two backward (into the column-parallel inputs); the vocabulary-parallel
embedding one forward, the head's input one backward, the head's logits one all-gather of
``T x V`` forward. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_train import _peak_rss_mb, init_rank, spawn_ranks  # noqa: E402

MODES = ("autotp2", "dp2", "zero3", "hf_tp2")


def _llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )


def _ds_config(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    tp = mode == "autotp2"
    return {
        "train_micro_batch_size_per_gpu": args.batch if tp else args.batch // 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3 if mode == "zero3" else 0},
        "tensor_parallel": {"autotp_size": 2 if tp else 1},
    }


def _held(model: torch.nn.Module) -> int:
    total = 0
    for param in model.parameters():
        shard = getattr(param, "ds_tensor", None)
        local = getattr(param, "to_local", None)
        total += shard.numel() if shard is not None else local().numel() if local else param.numel()
    return total


def _run_mode(
    rank: int, mode: str, args: argparse.Namespace, path: str, port: int, queue: Any
) -> None:
    init_rank(rank, 2, port)
    from transformers import AutoModelForCausalLM

    tensor_parallel = mode in ("autotp2", "hf_tp2")
    steps = args.warmup + args.steps
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (steps, args.batch, args.seq), generator=gen)
    if mode == "hf_tp2":
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        engine = None
    else:
        import shardspeed

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine, *_ = shardspeed.initialize(model=model, config=_ds_config(mode, args))
    from shardspeed import comm

    times, losses, volumes = [], [], []
    for step in range(steps):
        rows = data[step] if tensor_parallel else data[step][rank::2]
        dist.barrier()
        comm.reset_comm_volume()
        start = time.perf_counter()
        if engine is None:
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            loss = engine(input_ids=rows, labels=rows).loss
            engine.backward(loss)
            engine.step()
        elapsed = time.perf_counter() - start
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / 2)
        if step >= args.warmup:
            times.append(elapsed)
            volumes.append(comm.get_comm_volume())
    queue.put(
        {
            "rank": rank,
            "step_s": statistics.median(times),
            "losses": [round(x, 5) for x in losses],
            "held_params": _held(engine.module if engine is not None else model),
            "peak_rss_mb": round(_peak_rss_mb()),
            "comm": volumes[-1] if volumes else {},
        }
    )
    dist.destroy_process_group()


def _theory_bus_bytes(args: argparse.Namespace) -> float:
    tokens, elem, tp = args.batch * args.seq, 4, 2
    all_reduce = 2 * (tp - 1) / tp * tokens * args.hidden * elem
    gather = (tp - 1) / tp * tokens * args.vocab * elem
    return args.layers * 4 * all_reduce + 2 * all_reduce + gather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        model = LlamaForCausalLM(_llama_config(args))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(path)
        del model
        results = {}
        for port, mode in enumerate(args.modes.split(","), start=29610):
            ranks = spawn_ranks(_run_mode, 2, mode, args, path, port)
            results[mode] = {
                "step_s": round(max(r["step_s"] for r in ranks), 3),
                "tokens_per_s": round(args.batch * args.seq / max(r["step_s"] for r in ranks)),
                "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
                "held_params": [r["held_params"] for r in ranks],
                "losses": ranks[0]["losses"],
                "comm": ranks[0]["comm"],
            }
    bus = sum(v.get("bus_bytes", 0) for v in results.get("autotp2", {}).get("comm", {}).values())
    print(
        json.dumps(
            {
                "bench": "tp",
                "params": params,
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "args": vars(args),
                "modes": results,
                "autotp2_bus_bytes_per_step": bus,
                "autotp2_theory_bus_bytes_per_step": _theory_bus_bytes(args),
            }
        )
    )


if __name__ == "__main__":
    main()
