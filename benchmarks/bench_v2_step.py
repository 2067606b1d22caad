"""One decoding step, in isolation: shardspeed inference v2's ragged step against Hugging Face
``generate``'s and v1 fused decoding's step per token, at the same numbers of running sequences.

    python benchmarks/bench_v2_step.py                                   # CPU, fp32
    python benchmarks/bench_v2_step.py --device cuda --dtype bfloat16    # on a GPU

Where ``bench_serving.py`` measures a whole workload, this tells where its inter-token latency
comes from: for ``--sequences`` decoding sequences (prompts of ``--prompt`` tokens), the median
wall time of

* ``v2_step``: one ``RaggedScheduler.step()`` (scheduling, metadata, forward, sampling);
* ``v2_put``: one ``engine.put`` of the same decode tokens (no scheduler, no sampling);
* ``v2_mixed_put``: one ``engine.put`` of those decode tokens and a new ``--prompt``-token
  prompt (what a step is when a request arrives; never from a CUDA graph);
* ``v2_metadata``: building the step's ``RaggedBatchMetadata`` alone (host work and copies);
* ``hf_generate`` / ``v1_fused``: one decoding step of ``generate`` at that batch size, from
  the time of ``--new`` tokens less that of one token (prompt, set-up and first token out).

``--cuda-graph`` has the v2 figures decode from CUDA graphs (``enable_cuda_graph``, captured
before timing). Prints one JSON line. On a GPU each wall time includes the device sync the step ends with (the
sampled tokens come back to the host), so it is the inter-token gap a server would see.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import bench_serving as bs
import torch


def _median_ms(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1000.0, 3)


def _context(args: argparse.Namespace) -> int:
    """The most tokens a sequence reaches here: its prompt, the static batches' new tokens and
    every timed step's."""
    return args.prompt + args.new + 4 * args.repeats + 16


def _model(args: argparse.Namespace) -> Any:
    """bench_serving's small Llama, with positions for every token the steps here add."""
    return bs._model(argparse.Namespace(**vars(args), prompt_max=_context(args), out_max=0))


def _v2(base: Any, args: argparse.Namespace, seqs: int, sync: Callable[[], None]) -> dict:
    from shardspeed.inference.v2 import RaggedInferenceEngineConfig, build_hf_engine
    from shardspeed.inference.v2.ragged.paged_attention import RaggedBatchMetadata
    from shardspeed.inference.v2.scheduler import RaggedScheduler, SamplingParams

    context = _context(args)
    config = RaggedInferenceEngineConfig(
        dtype=args.dtype,
        enable_cuda_graph=args.cuda_graph,
        state_manager={
            "max_context": context,
            "max_ragged_batch_size": max(args.token_budget, seqs + args.prompt),
            "max_ragged_sequence_count": seqs + 1,
            "max_tracked_sequences": seqs + 1,
            "kv_block_size": args.block_size,
            "memory_config": {"mode": "allocate", "size": (seqs + 1) * (context // 16 + 2)},
        },
    )
    engine = build_hf_engine(copy.deepcopy(base), config)
    if args.cuda_graph:
        engine.capture_decode_graphs(seqs, context)
    scheduler = RaggedScheduler(engine, token_budget=args.token_budget)
    generator = torch.Generator().manual_seed(1)
    long = args.new + 4 * args.repeats
    for _ in range(seqs):
        prompt = torch.randint(4, args.vocab, (args.prompt,), generator=generator).tolist()
        scheduler.add_request(prompt, SamplingParams(max_new_tokens=long, min_new_tokens=long))
    while len(scheduler.step()) < seqs:  # the prompts, until every sequence decodes
        pass
    figures = {"v2_step": _median_ms(scheduler.step, args.repeats, sync)}
    # the same decode step straight through the engine: a separate set of sequences
    uids = list(range(10_000, 10_000 + seqs))
    scheduler_free = build_hf_engine(copy.deepcopy(base), config)
    if args.cuda_graph:
        scheduler_free.capture_decode_graphs(seqs, context)
    for uid in uids:
        scheduler_free.put(
            [uid], [torch.randint(4, args.vocab, (args.prompt,), generator=generator)]
        )
    last = [torch.tensor([3]) for _ in uids]
    figures["v2_put"] = _median_ms(lambda: scheduler_free.put(uids, last), args.repeats, sync)

    def mixed() -> None:  # the decode tokens and a new prompt in one batch, then it leaves
        prompt = torch.randint(4, args.vocab, (args.prompt,), generator=generator)
        scheduler_free.put([*uids, 20_000], [*last, prompt])
        scheduler_free.flush(20_000)

    figures["v2_mixed_put"] = _median_ms(mixed, args.repeats, sync)
    seen = [args.prompt + args.repeats] * seqs
    blocks = (args.prompt + args.repeats) // args.block_size + 1
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(seqs)]
    device = torch.device(args.device)
    figures["v2_metadata"] = _median_ms(
        lambda: RaggedBatchMetadata.build(seen, [1] * seqs, tables, args.block_size, device),
        args.repeats,
        sync,
    )
    return figures


def _static_step_ms(generate: Any, args: argparse.Namespace, seqs: int, sync: Any) -> float:
    """One decoding step of ``generate`` at batch ``seqs``: (time of ``--new`` tokens - time of
    one) / (``--new`` - 1), each the median of a few runs."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(4, args.vocab, (seqs, args.prompt), generator=generator).to(args.device)

    def run(new: int) -> Callable[[], Any]:
        def go() -> Any:
            with torch.no_grad():
                return generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )

        return go

    run(args.new)()  # warm-up
    repeats = max(3, args.repeats // 10)
    one = _median_ms(run(1), repeats, sync)
    many = _median_ms(run(args.new), repeats, sync)
    return round((many - one) / (args.new - 1), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", default="8,64", help="running sequences, comma-separated")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=33, help="tokens a static batch generates")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cuda-graph", action="store_true", help="v2 decodes from CUDA graphs (CUDA only)"
    )
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tests)")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.vocab, args.prompt, args.new = 64, 2, 256, 16, 5
        args.repeats, args.sequences = 5, "2,4"

    import shardspeed

    torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    base = _model(args)
    fused = shardspeed.init_inference(
        copy.deepcopy(base),
        dtype=getattr(torch, args.dtype),
        replace_with_kernel_inject=True,
        max_out_tokens=args.prompt + args.new + 1,
    )
    results: dict[str, dict[str, float]] = {}
    for seqs in [int(s) for s in args.sequences.split(",")]:
        figures = _v2(base, args, seqs, sync)
        figures["hf_generate"] = _static_step_ms(base.generate, args, seqs, sync)
        figures["v1_fused"] = _static_step_ms(fused.generate, args, seqs, sync)
        results[str(seqs)] = figures
    print(
        json.dumps(
            {
                "benchmark": "v2_step",
                "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
                "prompt": args.prompt,
                "device": args.device,
                "dtype": args.dtype,
                "cuda_graph": args.cuda_graph,
                "ms_per_step_by_sequences": results,
            }
        )
    )


if __name__ == "__main__":
    main()
