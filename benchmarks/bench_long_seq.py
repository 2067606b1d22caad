"""Long sequences (ALST): the longest sequence one training step fits in a fixed memory budget
per rank, for sequence parallelism 1, 2 and 4, without and with ALST's memory recipe (``TiledMLP``
on every MLP, ``TiledFusedLogitsLoss`` for the head and loss, and each decoder layer checkpointed,
as the tutorial's Trainer runs do; ``--checkpointing 0`` tiles only), and tokens/s, in one run.

    python benchmarks/bench_long_seq.py                 # CPU ranks, fp32, ~20 min when quiet
    python benchmarks/bench_long_seq.py --budget_gib 4  # another budget (longer: slower)

A Llama built from a config (``--hidden``, ``--layers``, ``--vocab``, ...) trains under the
engine at ZeRO-3 (``sequence_parallel_size`` = sp, so ZeRO shards over the ``sp`` ranks) with
``UlyssesSPAttentionHF`` (sdpa core: causal attention from the positions, no mask tensor). Each
rank takes its slice of one sequence, the shard losses are combined as DeepSpeed's tutorial
does, and one AdamW step runs. A trial is one step at one length in fresh rank processes; it
fits when every rank's peak resident memory (``ru_maxrss``: the interpreter, torch, the model
and optimizer states, and the step's activations) stays within ``--budget_gib``; the ranks run with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed blocks leave the RSS (otherwise glibc's cache of
freed memory, which differs between runs and rank counts, is counted as the step's). The longest
fitting length is found by a secant search on the peak RSS from ``--start`` (see
:func:`longest`; a length is a multiple of ``sp * --grain``). Tokens/s is measured at the longest fitting
length (whole-sequence tokens over the step's wall time, the slowest rank).

Prints one JSON line: per (sp, tiled) the longest length, its peak RSS, step time, tokens/s,
and the ratios of sp 2 and 4 to sp 1 (the issue's target: sp 2 >= 1.9x sp 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_train import _peak_rss_mb, init_rank, spawn_ranks  # noqa: E402

from tests.harness.distributed import free_port  # noqa: E402


def _llama(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1 << 22,
        tie_word_embeddings=False,
        use_cache=False,  # training: no key/value cache (it would hold every layer's keys)
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _tile_mlps(model: Any, seq_local: int) -> None:
    """Every decoder MLP computed over sequence tiles (DeepSpeed's rule of thumb: as many
    tiles as the local sequence has hidden sizes)."""
    from shardspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = max(1, math.ceil(seq_local / model.config.hidden_size))
    for layer in model.model.layers:
        mlp = layer.mlp
        original = type(mlp).forward

        def forward(self: Any, x: torch.Tensor, _fn: Any = original) -> torch.Tensor:
            return TiledMLP.apply(_fn, self, x, shards, list(self.parameters()))

        mlp.forward = types.MethodType(forward, mlp)


def _tiled_loss(model: Any, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Head and cross-entropy over tiles of ~16 MiB of logits; the mean over good tokens."""
    import torch.nn.functional as F

    from shardspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    head = model.lm_head
    vocab = model.config.vocab_size
    shards = max(1, math.ceil(hidden.shape[1] * vocab * 4 / (16 << 20)))

    def loss_fn(self: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self(x).float()
        return F.cross_entropy(logits.view(-1, vocab), y.view(-1), reduction="sum")

    total = TiledFusedLogitsLoss.apply(
        loss_fn, head, hidden, labels, None, shards, list(head.parameters()), "sum"
    )
    return total / (labels != -100).sum().clamp(min=1)


def _trial(rank: int, world: int, port: int, args: argparse.Namespace, seq: int, tiled: bool,
           queue: Any) -> None:  # fmt: skip
    torch.set_num_threads(1)
    init_rank(rank, world, port)
    import torch.nn.functional as F

    import shardspeed
    from shardspeed.runtime.sequence_parallel.loss import sequence_parallel_loss
    from shardspeed.utils import groups

    sp = world
    model = _llama(args)
    if sp > 1:
        from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=sp,
            micro_batch_size=1,
            seq_length=seq,
            seq_length_is_variable=True,
        )
    local = seq // sp
    if tiled:
        _tile_mlps(model, local)
        if args.checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "sequence_parallel_size": sp,
    }
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=config)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, seq), generator=gen)
    shift = F.pad(ids[:, 1:], (0, 1), value=-100)
    cut = slice(rank * local, (rank + 1) * local)
    mine_ids, mine_pos, mine_labels = ids[:, cut], torch.arange(seq)[None, cut], shift[:, cut]
    start = time.perf_counter()
    if tiled:
        hidden = engine.module.model(input_ids=mine_ids, position_ids=mine_pos).last_hidden_state
        loss = _tiled_loss(engine.module, hidden, mine_labels)
    else:
        logits = engine(input_ids=mine_ids, position_ids=mine_pos).logits
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), mine_labels.view(-1))
    if sp > 1:
        loss = sequence_parallel_loss(loss, mine_labels, groups._get_sequence_parallel_group())
    engine.backward(loss)
    engine.step()
    seconds = time.perf_counter() - start
    queue.put({"rank": rank, "rss_mb": _peak_rss_mb(), "seconds": seconds,
               "loss": float(loss.detach())})  # fmt: skip


def _run(args: argparse.Namespace, sp: int, seq: int, tiled: bool) -> dict[str, Any]:
    try:
        ranks = spawn_ranks(_trial, sp, sp, free_port(), args, seq, tiled)
    except RuntimeError as error:  # a rank killed (out of memory) or failed
        return {"seq": seq, "fits": False, "error": str(error)[:200]}
    rss = max(r["rss_mb"] for r in ranks)
    seconds = max(r["seconds"] for r in ranks)
    return {"seq": seq, "fits": rss <= args.budget_gib * 1024, "rss_mb": round(rss),
            "seconds": round(seconds, 2), "loss": ranks[0]["loss"]}  # fmt: skip


def longest(args: argparse.Namespace, sp: int, tiled: bool) -> dict[str, Any]:
    """The longest length that fits, by a secant search on peak RSS (about linear in the
    length: flash attention, tiles): two short trials give the slope, each next trial is the
    length the last two points predict for the budget (inside the bracket of the longest
    fitting and the shortest failing length, halved when the prediction falls outside), until
    the bracket is under ``--precision`` of the length (or one ``sp * --grain`` unit)."""
    unit = sp * args.grain
    trials: list[dict[str, Any]] = []
    budget = args.budget_gib * 1024

    def run(seq: int) -> dict[str, Any]:
        trial = _run(args, sp, seq, tiled)
        trials.append(trial)
        print(json.dumps({"sp": sp, "tiled": tiled, **trial}), file=sys.stderr, flush=True)
        return trial

    best: dict[str, Any] | None = None
    high: int | None = None
    seq = max(unit, args.start // unit * unit)
    while len(trials) < args.max_trials:
        trial = run(seq)
        if trial["fits"]:
            best = trial
        else:
            high = seq if high is None else min(high, seq)
        low = best["seq"] if best else 0
        if high is not None and high - low <= max(unit, low * args.precision):
            break
        measured = sorted((t for t in trials if "rss_mb" in t), key=lambda t: t["seq"])
        if len(measured) < 2:  # the slope needs two points: the second at twice the first
            guess = seq * 2 if trial["fits"] else seq // 2
        else:
            near = sorted(measured, key=lambda t: abs(t["rss_mb"] - budget))[:2]
            (s0, r0), (s1, r1) = ((t["seq"], t["rss_mb"]) for t in near)
            slope = (r1 - r0) / (s1 - s0) if s1 != s0 else 0.0
            guess = int(s0 + (budget - r0) / slope) if slope > 0 else seq * 2
            # a flat start (the tiles' fixed working set) predicts far too long: at most 4x
            guess = min(guess, 4 * max(t["seq"] for t in measured))
        guess = max(unit, guess // unit * unit)
        if guess <= low:  # the prediction is what fits already: test just above it
            guess = low + max(unit, int(low * args.precision) // unit * unit)
        if high is not None and not low < guess < high:
            guess = max(unit, (low + high) // 2 // unit * unit)
        if guess in {t["seq"] for t in trials}:
            break
        seq = guess
    if best is None:
        return {"sp": sp, "tiled": tiled, "longest": 0, "trials": len(trials)}
    return {
        "sp": sp,
        "tiled": tiled,
        "longest": best["seq"],
        "shortest_failing": high,
        "rss_mb": best["rss_mb"],
        "step_s": best["seconds"],
        "tokens_per_s": round(best["seq"] / best["seconds"], 1),
        "trials": len(trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget_gib", type=float, default=0.6)
    parser.add_argument("--sp", default="1,2,4")
    parser.add_argument("--tiled", default="0,1")
    parser.add_argument(
        "--checkpointing",
        type=int,
        default=1,
        help="1: tiled runs also checkpoint each decoder layer (ALST's recipe)",
    )
    parser.add_argument("--start", type=int, default=1024)
    parser.add_argument("--grain", type=int, default=64)
    parser.add_argument("--precision", type=float, default=0.05)
    parser.add_argument("--max_trials", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=4)
    args = parser.parse_args()
    # large blocks straight from mmap, returned when freed: the ranks' RSS then follows their
    # live memory instead of what glibc keeps cached (read by the rank processes at start)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    results = [
        longest(args, int(sp), bool(int(tiled)))
        for tiled in args.tiled.split(",")
        for sp in args.sp.split(",")
    ]
    by = {(r["sp"], r["tiled"]): r["longest"] for r in results}
    ratios = {
        f"sp{sp}_over_sp1{'_tiled' if tiled else ''}": round(by[(sp, tiled)] / by[(1, tiled)], 2)
        for (sp, tiled) in by
        if sp > 1 and by.get((1, tiled))
    }
    shape = {k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers", "heads",
                                           "kv_heads")}  # fmt: skip
    print(json.dumps({"bench": "long_seq", "budget_gib": args.budget_gib, "model": shape,
                      "zero_stage": 3, "checkpointing": args.checkpointing, "results": results,
                      "ratios": ratios}))  # fmt: skip


if __name__ == "__main__":
    main()
