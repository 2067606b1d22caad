"""ALST on one device: the memory and time of one training step (forward and backward) of a
Hugging Face Llama at long sequences, Hugging Face's own recipe (gradient checkpointing, sdpa,
full logits and cross-entropy) against ALST's single-device parts on top of it (``TiledMLP`` on
every MLP, ``TiledFusedLogitsLoss`` for head and loss, checkpointed hidden states offloaded to
host memory), and the gradients of the two compared at the shortest length.

    python benchmarks/bench_alst_gpu.py            # on a GPU: ~200M-parameter Llama, bf16
    python benchmarks/bench_alst_gpu.py --tiny     # anywhere in seconds: checks the script runs

Per length and mode: peak device memory (``torch.cuda.max_memory_allocated``), the step's
seconds, tokens/s, or ``"oom"``. A length is skipped once ``--time_limit`` seconds have passed.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_long_seq import _llama  # noqa: E402

from shardspeed.runtime.activation_checkpointing.offload_activations import (  # noqa: E402
    get_checkpoint_hidden_states_offloading_ctx_manager,
)
from shardspeed.runtime.sequence_parallel.ulysses_sp import (  # noqa: E402
    TiledFusedLogitsLoss,
    TiledMLP,
)


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _model(args: argparse.Namespace, tiled: bool) -> Any:
    model: Any = _llama(args)  # sdpa attention, Transformers' default
    model = model.to(_device(), args.dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if tiled:
        for layer in model.model.layers:
            mlp = layer.mlp
            original = type(mlp).forward

            def forward(self: Any, x: torch.Tensor, _fn: Any = original) -> torch.Tensor:
                shards = max(1, math.ceil(x.shape[1] / x.shape[2]))
                return TiledMLP.apply(_fn, self, x, shards, list(self.parameters()))

            mlp.forward = types.MethodType(forward, mlp)
    return model


def _step(model: Any, ids: torch.Tensor, labels: torch.Tensor, tiled: bool) -> float:
    vocab = model.config.vocab_size
    if not tiled:
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
        loss.backward()
        return float(loss.detach())
    with get_checkpoint_hidden_states_offloading_ctx_manager():
        hidden = model.model(input_ids=ids).last_hidden_state
        shards = max(1, math.ceil(hidden.shape[1] * vocab * 4 / (256 << 20)))

        def loss_fn(head: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(head(x).float().view(-1, vocab), y.view(-1), reduction="sum")

        head = model.lm_head
        total = TiledFusedLogitsLoss.apply(
            loss_fn, head, hidden, labels, None, shards, list(head.parameters()), "sum"
        )
        loss = total / (labels != -100).sum()
        loss.backward()
    return float(loss.detach())


def _batch(args: argparse.Namespace, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, args.vocab, (1, seq), generator=gen)
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    return ids.to(_device()), labels.to(_device())


def _measure(model: Any, args: argparse.Namespace, seq: int, tiled: bool) -> dict[str, Any]:
    ids, labels = _batch(args, seq)
    model.zero_grad(set_to_none=True)
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        loss = _step(model, ids, labels, tiled)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return {"oom": True}
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"peak_gib": None if peak is None else round(peak, 3), "step_s": round(seconds, 3),
            "tokens_per_s": round(seq / seconds, 1), "loss": round(loss, 5)}  # fmt: skip


def _grad_check(models: dict[bool, Any], args: argparse.Namespace, seq: int) -> dict[str, Any]:
    ids, labels = _batch(args, seq)
    losses, grads = {}, {}
    for tiled, model in models.items():
        model.zero_grad(set_to_none=True)
        losses[tiled] = _step(model, ids, labels, tiled)
        grads[tiled] = {n: p.grad.float() for n, p in model.named_parameters()}
    worst = max(
        float((grads[True][n] - g).norm() / g.norm().clamp(min=1e-12))
        for n, g in grads[False].items()
    )
    return {"seq": seq, "loss_hf": round(losses[False], 5), "loss_alst": round(losses[True], 5),
            "max_rel_grad_diff": worst}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16384,65536,131072,262144")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--time_limit", type=float, default=150.0)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.lengths, args.vocab, args.hidden, args.intermediate = "128,512", 512, 64, 128
        args.layers, args.heads, args.kv_heads = 2, 4, 2
    args.dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    started = time.perf_counter()
    models = {tiled: _model(args, tiled) for tiled in (False, True)}
    lengths = [int(x) for x in args.lengths.split(",")]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "dtype": str(args.dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in models[False].parameters()),
        "grad_check": _grad_check(models, args, lengths[0]),
        "runs": [],
    }
    for seq in lengths:
        if time.perf_counter() - started > args.time_limit:
            result["runs"].append({"seq": seq, "skipped": "time limit"})
            continue
        row: dict[str, Any] = {"seq": seq}
        for tiled in (False, True):
            row["alst" if tiled else "hf_checkpointing"] = _measure(models[tiled], args, seq, tiled)
        result["runs"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
