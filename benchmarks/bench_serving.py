"""Serving under load: shardspeed inference v2 (ragged batching over a blocked KV cache, Dynamic
SplitFuse) against Hugging Face ``generate`` with static batches and against shardspeed's v1
fused decoding with the same static batches, on one Poisson arrival workload, in one run.

    python benchmarks/bench_serving.py                       # small Llama, fp32, CPU
    python benchmarks/bench_serving.py --requests 64 --rate 8 --hidden 512 --layers 8

Each mode serves the same requests (prompt and output lengths uniform in the given ranges,
random prompt tokens, arrival times of a Poisson process of ``--rate`` requests/s) in real time
from one thread, as a server's engine loop would:

* ``shardspeed_v2``: every request is added to the :class:`RaggedScheduler` when it arrives;
  each ``step()`` runs one ragged forward (decode tokens of the running requests plus prompt
  chunks up to ``--token-budget``), so requests join and leave the batch at any step;
* ``hf_static``: when the model is idle, up to ``--batch`` arrived requests are left-padded into
  one batch and run by ``generate`` to the batch's longest output (Hugging Face's static
  batching); a streamer stamps each step's tokens, so time to first token is measured as if the
  server streamed;
* ``shardspeed_v1_fused``: the same static batching through ``init_inference(
  replace_with_kernel_inject=True)`` (fused blocks, one rectangular KV cache per batch).

Figures per mode: output tokens/s over the makespan (first arrival to last token), time to
first token (TTFT, from arrival) and inter-token latency (ITL, gap between a request's
consecutive tokens) at p50/p99, end-to-end request latency p50/p99; plus how many requests got
exactly the greedy tokens of ``hf_static``, and for v2 its steps, the forwards it ran eagerly
and its graph replays (with ``--cuda-graph``). ``--rounds`` serves the workload that many times with
the modes interleaved (each round builds every mode afresh and warms it up on prompts outside
the workload, so no prefix cache or warm state carries over): a mode's figures are those of its
median round by throughput, ``throughput_rounds`` lists every round's, and ``vs_hf_rounds`` each
round's throughput over Hugging Face's in the same round (the ratio printed is their median).
``--device cuda`` (and ``--dtype bfloat16``) runs every mode on a GPU; ``--cuda-graph`` has v2
decode from CUDA graphs (``enable_cuda_graph``, every shape captured before the workload, as a
server would at start-up). Prints one JSON line
(with the 1-minute load average before and after).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers


@dataclass
class Request:
    """One request of the workload and, once served, when each of its tokens came out."""

    arrival: float
    prompt: list[int]
    new_tokens: int
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def _workload(args: argparse.Namespace) -> list[Request]:
    generator = torch.Generator().manual_seed(args.seed)
    gaps = torch.empty(args.requests).exponential_(args.rate, generator=generator)
    arrivals = (torch.cumsum(gaps, 0) - gaps[0]).tolist()
    prompts = torch.randint(
        args.prompt_min, args.prompt_max + 1, (args.requests,), generator=generator
    )
    outputs = torch.randint(args.out_min, args.out_max + 1, (args.requests,), generator=generator)
    return [
        Request(
            arrival,
            torch.randint(4, args.vocab, (int(n),), generator=generator).tolist(),
            int(m),
        )
        for arrival, n, m in zip(arrivals, prompts, outputs, strict=True)
    ]


def _model(args: argparse.Namespace) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_max + args.out_max + 8,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


class _StepClock:
    """A Hugging Face streamer that stamps every decoding step (the first ``put`` is the
    prompt)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.steps: list[tuple[float, list[int]]] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.steps.append((time.perf_counter() - self.start, value.reshape(-1).tolist()))

    def end(self) -> None:
        pass


def _serve_static(
    generate: Any, requests: list[Request], batch: int, device: torch.device
) -> float:
    """Static batching in real time; returns the start of the clock (perf_counter)."""
    start = time.perf_counter()
    queue = list(requests)
    while queue:
        now = time.perf_counter() - start
        if queue[0].arrival > now:
            time.sleep(queue[0].arrival - now)
            continue
        arrived = [r for r in queue if r.arrival <= now][:batch]
        for r in arrived:
            queue.remove(r)
        longest = max(len(r.prompt) for r in arrived)
        ids = torch.zeros(len(arrived), longest, dtype=torch.long)
        mask = torch.zeros(len(arrived), longest, dtype=torch.long)
        for row, r in enumerate(arrived):
            ids[row, longest - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, longest - len(r.prompt) :] = 1
        new = max(r.new_tokens for r in arrived)
        clock = _StepClock(start)
        with torch.no_grad():
            generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        for row, r in enumerate(arrived):
            steps = clock.steps[: r.new_tokens]
            r.times = [t for t, _ in steps]
            r.tokens = [tokens[row] for _, tokens in steps]
    return start


def _serve_v2(scheduler: Any, params: Callable[[int], Any], requests: list[Request]) -> None:
    """The ragged scheduler in real time: requests join when they arrive, one step per loop."""
    start = time.perf_counter()
    queue = list(requests)
    by_uid: dict[int, Request] = {}
    done = 0
    while done < len(requests):
        now = time.perf_counter() - start
        while queue and queue[0].arrival <= now:
            r = queue.pop(0)
            by_uid[scheduler.add_request(r.prompt, params(r.new_tokens))] = r
        if not scheduler.has_work:
            time.sleep(max(queue[0].arrival - now, 0.0))
            continue
        events = scheduler.step()
        stamp = time.perf_counter() - start
        for event in events:
            r = by_uid[event.uid]
            r.times.append(stamp)
            r.tokens.append(event.token)
            done += bool(event.finished)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


def _figures(requests: list[Request]) -> dict[str, Any]:
    ttft = [r.times[0] - r.arrival for r in requests]
    itl = [b - a for r in requests for a, b in zip(r.times, r.times[1:], strict=False)]
    e2e = [r.times[-1] - r.arrival for r in requests]
    tokens = sum(len(r.times) for r in requests)
    makespan = max(r.times[-1] for r in requests) - min(r.arrival for r in requests)
    ms = 1000.0
    return {
        "tokens": tokens,
        "makespan_s": round(makespan, 3),
        "throughput_tok_s": round(tokens / makespan, 2),
        "ttft_ms_p50": round(_percentile(ttft, 0.5) * ms, 1),
        "ttft_ms_p99": round(_percentile(ttft, 0.99) * ms, 1),
        "itl_ms_p50": round(_percentile(itl, 0.5) * ms, 2),
        "itl_ms_p99": round(_percentile(itl, 0.99) * ms, 2),
        "e2e_ms_p50": round(_percentile(e2e, 0.5) * ms, 1),
        "e2e_ms_p99": round(_percentile(e2e, 0.99) * ms, 1),
    }


def _lower_median(values: list[Any], key: Callable[[Any], float]) -> Any:
    """The median of ``values`` by ``key`` (the lower one of an even count)."""
    return sorted(values, key=key)[(len(values) - 1) // 2]


def _fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.arrival, r.prompt, r.new_tokens) for r in requests]


def _v2_mode(base: Any, args: argparse.Namespace) -> tuple[Any, Callable[[int], Any]]:
    from shardspeed.inference.v2 import RaggedInferenceEngineConfig, build_hf_engine
    from shardspeed.inference.v2.scheduler import RaggedScheduler, SamplingParams

    context = args.prompt_max + args.out_max + 8
    graphs = getattr(args, "cuda_graph", False)  # bench_server_http's arguments have none
    config = RaggedInferenceEngineConfig(
        dtype=args.dtype,
        enable_cuda_graph=graphs,
        state_manager={
            "max_context": context,
            "max_ragged_batch_size": args.token_budget,
            "max_ragged_sequence_count": args.max_sequences or args.requests,
            "max_tracked_sequences": args.requests,
            "kv_block_size": args.block_size,
            "memory_config": {"mode": "allocate", "size": args.kv_blocks},
        },
    )
    engine = build_hf_engine(copy.deepcopy(base), config)
    if graphs:  # as a server does before it takes requests: no capture mid-workload
        engine.capture_decode_graphs(args.max_sequences or args.requests, context)
    eos = base.config.eos_token_id
    scheduler = RaggedScheduler(engine, token_budget=args.token_budget, eos_token_ids=eos)

    def params(new: int) -> Any:
        # as generate(min_new_tokens=new, max_new_tokens=new): end-of-sequence is suppressed
        # until the last token (ignore_eos would let the model pick it and carry on)
        return SamplingParams(max_new_tokens=new, min_new_tokens=new)

    return scheduler, params


def _v2_counts(scheduler: Any) -> dict[str, int]:
    """v2's steps so far, the forwards run eagerly (with graphs: the step parts no graph
    covered) and the graph replays."""
    engine = scheduler.engine
    graphs = engine.decode_graphs
    return {
        "steps": scheduler.num_steps,
        "eager_forwards": engine.eager_forwards,
        "graph_replays": 0 if graphs is None else graphs.replays,
    }


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload, model and v2 engine flags (shared with bench_server_http.py)."""
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=6.0, help="mean arrivals per second")
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--out-min", type=int, default=16)
    parser.add_argument("--out-max", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--token-budget", type=int, default=512, help="v2 tokens per step")
    parser.add_argument(
        "--max-sequences", type=int, default=None, help="v2 sequences per step (default: all)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="v2 KV block size")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="v2 KV blocks")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--batch", type=int, default=8, help="static batch size (HF, v1)")
    parser.add_argument("--rounds", type=int, default=3, help="modes interleaved, median round")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--modes", default="shardspeed_v2,hf_static,shardspeed_v1_fused")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="v2 decodes from CUDA graphs (enable_cuda_graph), all captured before the workload",
    )
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tests)")
    args = parser.parse_args()
    if args.tiny:
        args.requests, args.rate, args.rounds = 6, 1000.0, 2
        args.prompt_min, args.prompt_max, args.out_min, args.out_max = 3, 40, 1, 6
        args.hidden, args.layers, args.vocab, args.batch, args.token_budget = 64, 2, 256, 4, 32

    import shardspeed

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    base = _model(args)
    device = next(base.parameters()).device
    workload = _workload(args)
    # warm-up prompts outside the workload: a prefix cache must not start warm on its prompts
    warm = [Request(0.0, list(reversed(r.prompt)), 4) for r in workload[:4]]
    modes = args.modes.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        served: dict[str, list[Request]] = {}
        for mode in modes:
            requests = _fresh(workload)
            counts: dict[str, int] = {}
            if mode == "shardspeed_v2":
                scheduler, params = _v2_mode(base, args)
                _serve_v2(scheduler, params, _fresh(warm))
                before = _v2_counts(scheduler)
                _serve_v2(scheduler, params, requests)
                counts = {k: v - before[k] for k, v in _v2_counts(scheduler).items()}
            elif mode == "hf_static":
                _serve_static(base.generate, _fresh(warm), args.batch, device)
                _serve_static(base.generate, requests, args.batch, device)
            elif mode == "shardspeed_v1_fused":
                engine = shardspeed.init_inference(
                    copy.deepcopy(base),
                    dtype=getattr(torch, args.dtype),
                    replace_with_kernel_inject=True,
                    max_out_tokens=args.prompt_max + args.out_max + 1,
                )
                _serve_static(engine.generate, _fresh(warm), args.batch, device)
                _serve_static(engine.generate, requests, args.batch, device)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
            served[mode] = requests
            rounds[mode].append(_figures(requests) | counts)
        if "hf_static" in served:
            reference = served["hf_static"]
            hf = rounds["hf_static"][-1]["throughput_tok_s"]
            for mode, requests in served.items():
                figures = rounds[mode][-1]
                figures["greedy_equal_hf"] = sum(
                    a.tokens == b.tokens for a, b in zip(requests, reference, strict=True)
                )
                figures["vs_hf"] = round(figures["throughput_tok_s"] / hf, 3)
    results: dict[str, dict[str, Any]] = {}
    for mode, figures in rounds.items():
        results[mode] = dict(_lower_median(figures, key=lambda f: f["throughput_tok_s"]))
        results[mode]["throughput_rounds"] = [f["throughput_tok_s"] for f in figures]
        if "vs_hf" in figures[0]:
            ratios = [f["vs_hf"] for f in figures]
            results[mode].pop("vs_hf")
            results[mode]["vs_hf_rounds"] = [round(r, 2) for r in ratios]
            results[mode]["throughput_vs_hf"] = round(_lower_median(ratios, key=float), 2)
            results[mode]["greedy_equal_hf"] = min(f["greedy_equal_hf"] for f in figures)
    print(
        json.dumps(
            {
                "benchmark": "serving",
                "model": {
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "heads": args.heads,
                    "kv_heads": args.kv_heads,
                    "vocab": args.vocab,
                    "params_m": round(sum(p.numel() for p in base.parameters()) / 1e6, 2),
                },
                "workload": {
                    "requests": args.requests,
                    "rate_per_s": args.rate,
                    "prompt": [args.prompt_min, args.prompt_max],
                    "output": [args.out_min, args.out_max],
                    "static_batch": args.batch,
                    "token_budget": args.token_budget,
                    "max_sequences": args.max_sequences or args.requests,
                },
                "threads": args.threads,
                "rounds": args.rounds,
                "device": str(device),
                "dtype": args.dtype,
                "cuda_graph": args.cuda_graph,
                "results": results,
                "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
        )
    )


if __name__ == "__main__":
    main()
