"""How well a lower precision keeps float32's greedy tokens: Hugging Face ``generate`` on each
request alone, ``generate`` on left-padded static batches, and shardspeed inference v2's ragged
scheduler, all against ``generate`` alone in float32.

    python benchmarks/bench_v2_tokens.py --hidden 1024 --heads 16 --kv-heads 8   # CPU, bf16
    python benchmarks/bench_v2_tokens.py --device cuda --hidden 1024 --heads 16 --kv-heads 8

``bench_serving.py`` counts the requests whose tokens equal HF's static batches'. In float32
those are exact; in bfloat16 every path rounds differently (other batch shapes, other kernels),
and on a randomly initialised model, whose top logits lie close together, a rounding flips a
greedy token often. This gives the baseline for that count: how often each path keeps the
float32 tokens, and how often the paths agree with one another. The requests (all at once, no
timing) are ``bench_serving.py``'s workload. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import bench_serving as bs
import torch

Tokens = list[list[int]]


def _static(model: Any, requests: list[bs.Request], batch: int, device: torch.device) -> Tokens:
    """Greedy tokens of ``generate`` on left-padded batches of ``batch`` requests, in order."""
    served = [bs.Request(0.0, r.prompt, r.new_tokens) for r in requests]
    bs._serve_static(model.generate, served, batch, device)
    return [r.tokens for r in served]


def _v2(model: Any, requests: list[bs.Request], args: argparse.Namespace, dtype: str) -> Tokens:
    v2_args = copy.copy(args)
    v2_args.dtype = dtype
    scheduler, params = bs._v2_mode(model, v2_args)
    uids = [scheduler.add_request(r.prompt, params(r.new_tokens)) for r in requests]
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    while scheduler.has_work:
        for event in scheduler.step():
            tokens[event.uid].append(event.token)
    return [tokens[uid] for uid in uids]


def _agreement(a: Tokens, b: Tokens) -> dict[str, Any]:
    """How many requests have equal tokens, and the mean share of tokens before the first
    difference (1.0 where equal)."""
    kept = []
    for x, y in zip(a, b, strict=True):
        first = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        kept.append(first / len(x))
    return {
        "equal": sum(x == y for x, y in zip(a, b, strict=True)),
        "kept_share": round(sum(kept) / len(kept), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bs.add_workload_arguments(parser)
    parser.set_defaults(requests=32, prompt_max=128, out_max=32)
    parser.add_argument("--batch", type=int, default=8, help="static batch size (HF)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tests)")
    args = parser.parse_args()
    args.cuda_graph = False
    if args.tiny:
        args.requests, args.batch, args.token_budget = 6, 4, 32
        args.prompt_min, args.prompt_max, args.out_min, args.out_max = 3, 40, 1, 6
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 256
    torch.set_num_threads(args.threads)
    requests = bs._workload(args)
    low = args.dtype
    args.dtype = "float32"
    reference_model = bs._model(args)
    device = next(reference_model.parameters()).device
    reference = _static(reference_model, requests, 1, device)
    paths: dict[str, Tokens] = {
        "hf_batched_float32": _static(reference_model, requests, args.batch, device),
        "v2_float32": _v2(reference_model, requests, args, "float32"),
    }
    args.dtype = low
    model = bs._model(args)
    paths[f"hf_alone_{low}"] = _static(model, requests, 1, device)
    paths[f"hf_batched_{low}"] = _static(model, requests, args.batch, device)
    paths[f"v2_{low}"] = _v2(model, requests, args, low)
    vs_float32 = {name: _agreement(tokens, reference) for name, tokens in paths.items()}
    between = {
        f"v2_vs_hf_batched_{low}": _agreement(paths[f"v2_{low}"], paths[f"hf_batched_{low}"]),
        f"hf_alone_vs_hf_batched_{low}": _agreement(
            paths[f"hf_alone_{low}"], paths[f"hf_batched_{low}"]
        ),
        f"v2_vs_hf_alone_{low}": _agreement(paths[f"v2_{low}"], paths[f"hf_alone_{low}"]),
    }
    print(
        json.dumps(
            {
                "benchmark": "v2_tokens",
                "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
                "requests": args.requests,
                "device": str(device),
                "dtype": low,
                "vs_hf_alone_float32": vs_float32,
                "between": between,
            }
        )
    )


if __name__ == "__main__":
    main()
