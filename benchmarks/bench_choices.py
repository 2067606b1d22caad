"""``n`` choices of one prompt: the scheduler computes the prompt once and the other choices
take its KV blocks from the prefix cache, against the same engine with prefix caching off (each
choice computes the whole prompt), in one run.

    python benchmarks/bench_choices.py                 # 4 prompts x n=8, 250 tokens, 32 new

``--prompts`` prompts of ``--prompt-len`` random tokens, each asked for ``--n`` sampled choices
(seeds 0..n-1) of ``--new`` tokens, all submitted at once to bench_serving's small Llama and run
to completion (fp32, CPU). Per mode: the median wall time of ``--rounds`` (modes alternating,
each built afresh), the tokens the model computed, and how many choices drew the same tokens in
both modes. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import bench_serving as bs
import torch


def _run(base: Any, args: argparse.Namespace, prompts: list[list[int]], shared: bool) -> Any:
    from shardspeed.inference.v2 import build_hf_engine
    from shardspeed.inference.v2.scheduler import RaggedScheduler, SamplingParams

    count = len(prompts) * args.n
    config = {
        "state_manager": {
            "max_context": args.prompt_len + args.new + 8,
            "max_ragged_batch_size": args.token_budget,
            "max_ragged_sequence_count": count,
            "max_tracked_sequences": count,
            "kv_block_size": args.block_size,
            "memory_config": {"mode": "allocate", "size": args.kv_blocks},
            "prefix_caching": shared,
        }
    }
    engine = build_hf_engine(copy.deepcopy(base), config)
    scheduler = RaggedScheduler(engine, token_budget=args.token_budget)
    uids = [
        scheduler.add_request(
            prompt,
            SamplingParams(
                max_new_tokens=args.new, min_new_tokens=args.new, do_sample=True, seed=j
            ),
        )
        for prompt in prompts
        for j in range(args.n)
    ]
    start = time.perf_counter()
    outputs = scheduler.run_to_completion()
    seconds = time.perf_counter() - start
    return seconds, engine.computed_tokens, [outputs[u] for u in uids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=250)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tests)")
    args = parser.parse_args()
    model_args = argparse.Namespace(
        hidden=256, layers=4, heads=8, kv_heads=4, vocab=4096, prompt_max=args.prompt_len,
        out_max=args.new, device="cpu", dtype="float32",
    )  # fmt: skip
    if args.tiny:
        args.prompts, args.n, args.prompt_len, args.new, args.rounds = 2, 3, 40, 4, 1
        model_args.hidden, model_args.layers, model_args.vocab = 64, 2, 256
    torch.set_num_threads(args.threads)
    base = bs._model(model_args)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, model_args.vocab, (args.prompt_len,), generator=generator).tolist()
        for _ in range(args.prompts)
    ]
    runs: dict[str, list[Any]] = {"shared": [], "unshared": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(_run(base, args, prompts, shared=mode == "shared"))
    results = {}
    for mode, done in runs.items():
        results[mode] = {
            "seconds": round(statistics.median(r[0] for r in done), 3),
            "seconds_rounds": [round(r[0], 3) for r in done],
            "computed_tokens": done[0][1],
        }
    same = sum(a == b for a, b in zip(runs["shared"][0][2], runs["unshared"][0][2], strict=True))
    print(
        json.dumps(
            {
                "benchmark": "choices",
                "workload": {
                    "prompts": args.prompts,
                    "n": args.n,
                    "prompt_len": args.prompt_len,
                    "new_tokens": args.new,
                    "token_budget": args.token_budget,
                },
                "rounds": args.rounds,
                "results": results,
                "speedup": round(results["unshared"]["seconds"] / results["shared"]["seconds"], 2),
                "choices_equal": same,
                "choices": args.prompts * args.n,
            }
        )
    )


if __name__ == "__main__":
    main()
