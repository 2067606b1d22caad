"""The OpenAI server under load over real HTTP: ``shardspeed serve`` started as a process and
streamed ``/v1/completions`` requests from concurrent clients, against the same engine driven
in-process (``bench_serving.py``'s ``shardspeed_v2`` mode), on one Poisson workload, in one run:
what the HTTP layer (uvicorn, JSON, server-sent events, detokenizing, the engine loop's thread
handing tokens to asyncio) costs.

    python benchmarks/bench_server_http.py --rate 100 --requests 64   # saturating, small Llama

The model is bench_serving's small Llama, saved with a word-level tokenizer (token ``i`` is the
word ``t{i}``, so each streamed word is one token). Each request is one asyncio task of an
``httpx`` client that sends, at its arrival time, the prompt as token ids with
``max_tokens = min_tokens = n`` (greedy; end-of-sequence suppressed until the last token, as
``generate(min_new_tokens=n)``) and stamps every streamed token when it is read. The client
runs on the same machine as the server, so its own parsing competes for the cores. Figures as
bench_serving's (tokens/s over the makespan, TTFT, ITL, end-to-end p50/p99), per mode the median
round of ``--rounds`` with the modes alternating, ``http_vs_in_process`` the median of the
rounds' throughput ratios, and whether both modes gave every request the same tokens. The
server runs without prefix caching, so later rounds find nothing cached from earlier ones.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_serving as bs
import torch

STARTUP_S = 180.0


def _save(model: Any, folder: Path) -> None:
    """The model and a word-level tokenizer of its vocabulary (``t{i}`` is token ``i``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # no special tokens: decoding skips none, so every token is one word of the stream (the
    # server takes end-of-sequence from the model's config)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.save_pretrained(str(folder))
    model.save_pretrained(str(folder))


def _start(folder: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str, Path]:
    """``shardspeed serve`` on ``folder`` (a free port, the bench's engine settings)."""
    log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    context = args.prompt_max + args.out_max + 8
    cmd = [
        sys.executable, "-m", "shardspeed.launcher.runner", "serve", "--model", str(folder),
        "--port", "0", "--served-model-name", "bench", "--max-batch-tokens",
        str(args.token_budget), "--max-num-seqs", str(args.max_sequences or args.requests),
        "--max-context", str(context), "--kv-block-size", str(args.block_size), "--kv-blocks",
        str(args.kv_blocks), "--dtype", args.dtype, "--no-prefix-caching",
        "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log.read_text())
        if found:
            return proc, found.group(1), log
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start in {STARTUP_S} s: {log.read_text()}")


async def _one(client: Any, url: str, request: bs.Request, start: float) -> None:
    """Send ``request`` at its arrival time and stamp each streamed token."""
    delay = request.arrival - (time.perf_counter() - start)
    if delay > 0:
        await asyncio.sleep(delay)
    body = {
        "model": "bench", "prompt": request.prompt, "max_tokens": request.new_tokens,
        "min_tokens": request.new_tokens, "temperature": 0, "stream": True,
    }  # fmt: skip
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"the server answered {reply.status_code}: {await reply.aread()}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            words = json.loads(line[6:])["choices"][0]["text"].split()
            stamp = time.perf_counter() - start
            for word in words:
                request.times.append(stamp)
                request.tokens.append(int(word[1:]))


async def _serve_http(url: str, requests: list[bs.Request]) -> None:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(_one(client, url, r, start) for r in requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bs.add_workload_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tests)")
    args = parser.parse_args()
    args.device, args.dtype, args.batch = "cpu", "float32", 8
    if args.tiny:
        args.requests, args.rate, args.rounds = 6, 1000.0, 2
        args.prompt_min, args.prompt_max, args.out_min, args.out_max = 3, 40, 1, 6
        args.hidden, args.layers, args.vocab, args.token_budget = 64, 2, 256, 32
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    base = bs._model(args)
    workload = bs._workload(args)
    warm = [bs.Request(0.0, list(reversed(r.prompt)), 4) for r in workload[:4]]
    rounds: dict[str, list[dict[str, Any]]] = {"in_process": [], "http": []}
    equal: list[int] = []
    with tempfile.TemporaryDirectory() as folder:
        _save(base, Path(folder))
        proc, url, log = _start(Path(folder), args)
        try:
            asyncio.run(_serve_http(url, bs._fresh(warm)))
            for _ in range(args.rounds):
                local = bs._fresh(workload)
                scheduler, params = bs._v2_mode(base, args)
                bs._serve_v2(scheduler, params, bs._fresh(warm))
                bs._serve_v2(scheduler, params, local)
                rounds["in_process"].append(bs._figures(local))
                remote = bs._fresh(workload)
                asyncio.run(_serve_http(url, remote))
                rounds["http"].append(bs._figures(remote))
                equal.append(sum(a.tokens == b.tokens for a, b in zip(local, remote, strict=True)))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            log.unlink()
    ratios = [
        h["throughput_tok_s"] / p["throughput_tok_s"]
        for h, p in zip(rounds["http"], rounds["in_process"], strict=True)
    ]
    results = {}
    for mode, figures in rounds.items():
        results[mode] = dict(bs._lower_median(figures, key=lambda f: f["throughput_tok_s"]))
        results[mode]["throughput_rounds"] = [f["throughput_tok_s"] for f in figures]
    print(
        json.dumps(
            {
                "benchmark": "server_http",
                "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
                "workload": {
                    "requests": args.requests,
                    "rate_per_s": args.rate,
                    "prompt": [args.prompt_min, args.prompt_max],
                    "output": [args.out_min, args.out_max],
                    "token_budget": args.token_budget,
                },
                "threads": args.threads,
                "rounds": args.rounds,
                "results": results,
                "http_vs_in_process_rounds": [round(r, 3) for r in ratios],
                "http_vs_in_process": round(bs._lower_median(ratios, key=float), 3),
                "tokens_equal": min(equal),
                "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
        )
    )


if __name__ == "__main__":
    main()
