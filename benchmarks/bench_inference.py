"""Inference latency: shardspeed's fused decoding vs Hugging Face eager and ``torch.compile``d
Hugging Face on the same Llama-architecture model, batch 1 and 8, plus TP 1 vs TP 2 on 2 ranks.

    python benchmarks/bench_inference.py                      # ~30M-param Llama, fp32, CPU
    python benchmarks/bench_inference.py --hidden 1024 --layers 8 --batches 1,8 --no-compile

Every mode generates greedily through ``generate`` with the same prompt. ``prefill_ms`` is the
time of ``generate(max_new_tokens=1)`` (the prompt's forward and one token);
``decode_ms_per_token`` is ``(generate(1 + N) - generate(1)) / N``, the cost of one more token
with a warm KV cache; each is the best of ``--repeats`` rounds, the modes interleaved within a
round (on a shared machine the minimum is the least disturbed run). Modes:

* ``hf_eager``: the Hugging Face model as built (SDPA attention, dynamic cache);
* ``hf_compiled``: the same model with a static cache and ``torch.compile``d forward (Hugging
  Face's recipe), timed after warm-up compilations;
* ``shardspeed_autotp``: ``init_inference`` without injection (the Hugging Face forward);
* ``shardspeed_fused``: ``init_inference(replace_with_kernel_inject=True)``;
* ``shardspeed_fused_compiled``: the same with ``engine.compile()`` (the per-token step, whose
  shapes never change, compiled once by inductor; the prompt step stays eager);
* ``shardspeed_fused_tp1_2ranks`` and ``shardspeed_fused_tp2``: 2 gloo ranks (2 processes, one
  thread each) running the fused model whole on each rank side by side (TP 1), and split over
  both (TP 2), timed interleaved in the same rounds; the slower rank's figure of each.

``load_tp2``: the model saved as safetensors shards of ``--shard_size``, then loaded at TP 2 by
2 fresh ranks from a model built with ``init_empty_weights``; per rank, the bytes of its slice
and the peak growth of its resident set while loading (sampled every 0.5 ms), against the
largest shard.

Single-process modes use ``--threads`` threads (default 1, so TP 2 uses the same cores per rank).
Greedy tokens of every mode are checked against ``hf_eager``. Prints one JSON line, with the
1-minute load average before and after the run.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import socket
import time
from typing import Any

import torch
import transformers


def _config(args: argparse.Namespace) -> Any:
    return transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new + 8,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )


def _model(args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(args)).eval()
    model.requires_grad_(False)
    return model


def _prompt(args: argparse.Namespace, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(1, args.vocab, (batch, args.prompt), generator=generator)


def _generate(model: Any, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return out


def _once(model: Any, ids: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    _generate(model, ids, new)
    return time.perf_counter() - start


def _warm(model: Any, ids: torch.Tensor, args: argparse.Namespace) -> list[list[int]]:
    """Run the compilations and allocations once; return the greedy tokens."""
    for _ in range(args.warmup):
        _generate(model, ids, 1)
        _generate(model, ids, 1 + args.new)
    tokens: list[list[int]] = _generate(model, ids, args.new)[:, ids.shape[1] :].tolist()
    return tokens


def _figures(prefill: list[float], full: list[float], new: int) -> dict[str, Any]:
    # best of the rounds: on a shared machine the minimum is the least disturbed run
    one, total = min(prefill), min(full)
    return {
        "prefill_ms": round(one * 1000, 2),
        "decode_ms_per_token": round((total - one) / new * 1000, 3),
    }


def _measure(model: Any, ids: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    tokens = _warm(model, ids, args)
    prefill = [_once(model, ids, 1) for _ in range(args.repeats)]
    full = [_once(model, ids, 1 + args.new) for _ in range(args.repeats)]
    return _figures(prefill, full, args.new) | {"tokens": tokens}


def _compiled(model: Any) -> Any:
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, dynamic=False)
    return model


def _fused_compiled(builders: dict[str, Any]) -> Any:
    """The fused decoder with its per-token step compiled (``engine.compile()``, inductor)."""
    engine = builders["shardspeed_fused"]()
    engine.compile()
    return engine


def _single_process(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    import shardspeed

    torch.set_num_threads(args.threads)
    base = _model(args)
    builders: dict[str, Any] = {
        "hf_eager": lambda: base,
        "shardspeed_autotp": lambda: shardspeed.init_inference(
            copy.deepcopy(base), dtype=torch.float32
        ),
        "shardspeed_fused": lambda: shardspeed.init_inference(
            copy.deepcopy(base),
            dtype=torch.float32,
            replace_with_kernel_inject=True,
            max_out_tokens=args.prompt + args.new + 1,
        ),
    }
    if args.compile:
        builders["hf_compiled"] = lambda: _compiled(copy.deepcopy(base))
        builders["shardspeed_fused_compiled"] = lambda: _fused_compiled(builders)
    return _interleaved({name: build() for name, build in builders.items()}, args)


def _interleaved(models: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Warm every model at every batch size, then time them in rounds, modes interleaved within
    a round (so a busy spell hits them all alike); per mode and batch the figures and tokens."""
    prompts = {batch: _prompt(args, batch) for batch in args.batches}
    tokens = {(n, b): _warm(m, prompts[b], args) for n, m in models.items() for b in args.batches}
    prefill: dict[tuple[str, int], list[float]] = {key: [] for key in tokens}
    full: dict[tuple[str, int], list[float]] = {key: [] for key in tokens}
    for _ in range(args.repeats):
        for (name, batch), times in prefill.items():
            times.append(_once(models[name], prompts[batch], 1))
            full[(name, batch)].append(_once(models[name], prompts[batch], 1 + args.new))
    results: dict[str, dict[str, Any]] = {}
    for (name, batch), times in prefill.items():
        row = _figures(times, full[(name, batch)], args.new) | {"tokens": tokens[(name, batch)]}
        results.setdefault(name, {})[f"batch{batch}"] = row
    return results


def _join(rank: int, port: int) -> None:
    """Join a 2-rank gloo group, one thread, the ranks' info logs kept off stdout."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        SHARDSPEED_LOG_LEVEL="WARNING",
    )
    torch.set_num_threads(1)
    import shardspeed  # after the environment: its logger reads SHARDSPEED_LOG_LEVEL

    shardspeed.comm.init_distributed(dist_backend="gloo")


def _tp_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """Both ranks build the fused model twice, whole (TP 1: each rank its own copy, running
    side by side) and split (TP 2), and time them interleaved in the same rounds."""
    _join(rank, port)
    import shardspeed

    def fused(tp_size: int) -> Any:
        return shardspeed.init_inference(
            _model(args),
            dtype=torch.float32,
            tensor_parallel={"tp_size": tp_size},
            replace_with_kernel_inject=True,
            max_out_tokens=args.prompt + args.new + 1,
        )

    figures = _interleaved({"tp1": fused(1), "tp2": fused(2)}, args)
    queue.put({"rank": rank, "figures": figures})


def _tp2(args: argparse.Namespace) -> dict[str, Any]:
    """TP 1 (one copy per rank) and TP 2 on 2 ranks: the slower rank's figure of each."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join()
    modes: dict[str, Any] = {}
    for mode, name in (("tp1", "shardspeed_fused_tp1_2ranks"), ("tp2", "shardspeed_fused_tp2")):
        modes[name] = {}
        for batch, row in results[0]["figures"][mode].items():
            other = results[1]["figures"][mode][batch]
            modes[name][batch] = {
                "prefill_ms": max(row["prefill_ms"], other["prefill_ms"]),
                "decode_ms_per_token": max(
                    row["decode_ms_per_token"], other["decode_ms_per_token"]
                ),
                "tokens": row["tokens"] if row["tokens"] == other["tokens"] else None,
            }
    return modes


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _load_rank(rank: int, port: int, directory: str, args: argparse.Namespace, queue: Any) -> None:
    """Build the model with empty weights and load this rank's slices; sample the RSS."""
    import threading

    from accelerate import init_empty_weights

    _join(rank, port)
    import shardspeed

    with init_empty_weights():
        model = transformers.LlamaForCausalLM(_config(args))
    before = _rss()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    engine = shardspeed.init_inference(
        model, checkpoint=directory, dtype=torch.float32, tensor_parallel={"tp_size": 2}
    )
    done.set()
    sampler.join()
    held = sum(t.untyped_storage().nbytes() for t in engine.module.parameters())
    queue.put({"rank": rank, "peak_rss_growth": peak[0] - before, "slice_bytes": held})


def _load(args: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS growth per rank while loading a sharded safetensors checkpoint at TP 2."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as directory:
        model = _model(args)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(directory, max_shard_size=args.shard_size)
        del model
        shards = sorted(Path(directory).glob("*.safetensors"))
        largest = max(f.stat().st_size for f in shards)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_load_rank, args=(r, port, directory, args, queue)) for r in range(2)
        ]
        for proc in procs:
            proc.start()
        ranks = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for proc in procs:
            proc.join()
    mb = 2**20
    return {
        "model_mb": round(full / mb, 1),
        "shards": len(shards),
        "largest_shard_mb": round(largest / mb, 1),
        "per_rank": [
            {
                "slice_mb": round(r["slice_bytes"] / mb, 1),
                "peak_rss_growth_mb": round(r["peak_rss_growth"] / mb, 1),
            }
            for r in ranks
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--no-tp2", dest="tp2", action="store_false")
    parser.add_argument("--no-load", dest="load", action="store_false")
    parser.add_argument("--shard_size", default="8MB", help="safetensors shard size for --load")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    modes = _single_process(args)
    if args.tp2:
        modes |= _tp2(args)
    reference = {batch: row["tokens"] for batch, row in modes["hf_eager"].items()}
    for figures in modes.values():
        for batch, row in figures.items():
            row["tokens_equal_hf_eager"] = row.pop("tokens") == reference[batch]
    load = _load(args) if args.load else None
    params = sum(p.numel() for p in _model(args).parameters())
    print(
        json.dumps(
            {
                "model": f"llama hidden={args.hidden} layers={args.layers} heads={args.heads}/"
                f"{args.kv_heads} vocab={args.vocab}",
                "params": params,
                "prompt": args.prompt,
                "new_tokens": args.new,
                "threads": args.threads,
                "device": "cpu",
                "dtype": "fp32",
                "torch": torch.__version__,
                # the 1-minute load average before and after: the machine may be shared
                "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "modes": modes,
                "load_tp2": load,
            }
        )
    )


if __name__ == "__main__":
    main()
