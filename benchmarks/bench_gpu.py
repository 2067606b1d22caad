"""One-device figures: a GPT's training step per ZeRO stage (bf16; CPU and NVMe offload) against
the same model in plain PyTorch, and a Hugging Face Llama's decoding, eager against shardspeed's
fused decoding with and without CUDA graphs.

    python benchmarks/bench_gpu.py                 # on a GPU (~200M-parameter GPT, bf16)
    python benchmarks/bench_gpu.py --tiny          # anywhere in seconds: checks the script runs

Training reports per mode the median step time, tokens/s, model FLOPs utilisation (6 x parameters
+ 12 x layers x width x sequence FLOPs per token, against the device's dense bf16 peak when the
device is known) and peak device memory; the peer is plain PyTorch (bf16 autocast over fp32
weights, ``torch.optim.AdamW``), which is what ZeRO stage 0 with ``bf16`` does. Each mode's loss
after the timed steps is reported next to the peer's (same seed, same batches). Decoding reports
prefill and per-token decode time (best of the repeats) and whether greedy tokens equal eager's.
Prints one JSON line (world size 1; the process group is NCCL on CUDA, gloo elsewhere).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.gpt_model import GPT, GPTConfig  # noqa: E402

# dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a fragment of the device name
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _reset_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def _batches(cfg: GPTConfig, micro: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        tokens = torch.randint(cfg.vocab_size, (micro, cfg.block_size + 1), generator=gen)
        out.append((tokens[:, :-1].to(_device()), tokens[:, 1:].to(_device())))
    return out


def _timed(step: Callable[[torch.Tensor, torch.Tensor], float], batches: list, warmup: int) -> dict:
    times, losses = [], []
    for index, (x, y) in enumerate(batches):
        _sync()
        start = time.perf_counter()
        losses.append(step(x, y))
        _sync()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "losses": losses}


def _torch_mode(cfg: GPTConfig, batches: list, warmup: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(_device())
    fused = torch.cuda.is_available()
    if args.optimizer == "muon":
        opts = _torch_muon(model, args, fused)
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=fused)]
    dtype = torch.bfloat16

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast(_device().type, dtype=dtype):
            loss = model(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)

    return _timed(step, batches, warmup)


def _torch_muon(model: torch.nn.Module, args: argparse.Namespace, fused: bool) -> list:
    """torch.optim.Muon on the matrices DeepSpeed's rule tags, AdamW on the rest, with the
    settings ``_optimizer_section`` gives shardspeed's Muon (its AdamW defaults)."""
    from shardspeed.ops.muon.tagging import wants_muon

    named = list(model.named_parameters())
    matrices = [p for n, p in named if wants_muon(n, p)]
    rest = [p for n, p in named if not wants_muon(n, p)]
    muon = torch.optim.Muon(matrices, lr=args.muon_lr, weight_decay=0.0, momentum=0.95)
    adam = torch.optim.AdamW(
        rest, lr=args.lr, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0, fused=fused
    )
    return [muon, adam]


def _optimizer_section(args: argparse.Namespace) -> dict[str, Any]:
    if args.optimizer == "muon":
        return {"type": "Muon", "params": {"muon_lr": args.muon_lr, "adam_lr": args.lr}}
    return {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}}


def _zero_section(mode: str, nvme: str) -> dict[str, Any]:
    stage = int(mode.split("stage")[1][0])
    zero: dict[str, Any] = {"stage": stage}
    if mode.endswith("offload_cpu"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if mode.endswith("offload_nvme"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    return zero


def _shardspeed_mode(
    mode: str, cfg: GPTConfig, batches: list, warmup: int, args: argparse.Namespace
) -> dict:
    import shardspeed

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme:
        config = {
            "train_micro_batch_size_per_gpu": args.micro,
            "bf16": {"enabled": True},
            "optimizer": _optimizer_section(args),
            "zero_optimization": _zero_section(mode, nvme),
        }
        engine, *_ = shardspeed.initialize(model=GPT(cfg), config=config)

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return float(loss)

        figures = _timed(step, batches, warmup)
        engine.destroy()
    return figures


def train(args: argparse.Namespace) -> dict[str, Any]:
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    params = sum(p.numel() for p in GPT(cfg).parameters())
    flops_per_token = 6 * params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    tokens = args.micro * cfg.block_size
    peak = _peak_flops()
    results: dict[str, Any] = {"params": params, "tokens_per_step": tokens}
    for mode in ["torch_bf16_autocast", *args.modes.split(",")]:
        offloaded = "offload" in mode
        warmup = 1 if offloaded else args.warmup
        count = warmup + (args.offload_steps if offloaded else args.steps)
        batches = _batches(cfg, args.micro, count)
        _reset_memory()
        if mode.startswith("torch"):
            figures = _torch_mode(cfg, batches, warmup, args)
        else:
            figures = _shardspeed_mode(mode, cfg, batches, warmup, args)
        figures["tokens_per_s"] = round(tokens / figures["step_s"], 1)
        figures["mfu"] = (
            round(flops_per_token * tokens / figures["step_s"] / peak, 4) if peak else None
        )
        figures["peak_gib"] = _peak_gib()
        figures["step_s"] = round(figures["step_s"], 5)
        losses = figures.pop("losses")
        reference = results.setdefault("_torch_losses", losses)
        figures["final_loss"] = round(losses[-1], 5)
        # same seed, same batches: the loss curve against plain PyTorch's over the common steps
        figures["max_loss_diff_vs_torch"] = round(
            max(abs(a - b) for a, b in zip(losses, reference, strict=False)), 5
        )
        results[mode] = figures
        print(f"# {mode}: {figures}", file=sys.stderr, flush=True)
    del results["_torch_losses"]
    return results


def _llama(args: argparse.Namespace) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.dec_hidden,
        intermediate_size=args.dec_hidden * 11 // 4,
        num_hidden_layers=args.dec_layers,
        num_attention_heads=args.dec_hidden // 64 if args.dec_hidden >= 64 else 2,
        num_key_value_heads=max(1, args.dec_hidden // 256),
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new + 8,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().requires_grad_(False)
    return model.to(_device(), torch.bfloat16)


def _generate(model: Any, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return out[:, ids.shape[1] :]


def _once(model: Any, ids: torch.Tensor, new: int) -> float:
    _sync()
    start = time.perf_counter()
    _generate(model, ids, new)
    _sync()
    return time.perf_counter() - start


def decode(args: argparse.Namespace) -> dict[str, Any]:
    import shardspeed

    base = _llama(args)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=gen).to(_device())

    def fused(graph: bool) -> Any:
        return shardspeed.init_inference(
            copy.deepcopy(base),
            dtype=torch.bfloat16,
            replace_with_kernel_inject=True,
            max_out_tokens=args.prompt + args.new + 1,
            enable_cuda_graph=graph,
        )

    builders: dict[str, Callable[[], Any]] = {
        "hf_eager": lambda: base,
        "fused": lambda: fused(False),
    }
    if torch.cuda.is_available():
        builders["fused_cuda_graph"] = lambda: fused(True)
    results: dict[str, Any] = {"batch": args.batch, "prompt": args.prompt, "new": args.new}
    want: torch.Tensor | None = None
    for name, build in builders.items():
        model = build()
        tokens = _generate(model, ids, args.new)  # warm: allocations, capture
        want = tokens if want is None else want
        prefill = min(_once(model, ids, 1) for _ in range(args.repeats))
        full = min(_once(model, ids, 1 + args.new) for _ in range(args.repeats))
        results[name] = {
            "prefill_ms": round(prefill * 1000, 3),
            "decode_ms_per_token": round((full - prefill) / args.new * 1000, 4),
            "tokens_equal_eager": float((tokens == want).float().mean()),
        }
        print(f"# decode {name}: {results[name]}", file=sys.stderr, flush=True)
    eager = results["hf_eager"]["decode_ms_per_token"]
    for name in builders:
        results[name]["decode_speedup_vs_eager"] = round(
            eager / results[name]["decode_ms_per_token"], 3
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test anywhere")
    ap.add_argument("--only", choices=["train", "decode", "both"], default="both")
    ap.add_argument(
        "--modes",
        default="stage0,stage1,stage2,stage3,stage2_offload_cpu,stage3_offload_cpu,stage3_offload_nvme",
    )
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--n_embd", type=int, default=1024)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: shardspeed's Muon against torch.optim.Muon + AdamW (--lr is AdamW's)",
    )
    ap.add_argument("--muon_lr", type=float, default=0.02, help="the Muon matrices' lr")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--offload_steps", type=int, default=2, help="timed, after 1 warm-up step")
    ap.add_argument("--nvme_dir", default=None, help="folder for the NVMe swap files")
    ap.add_argument("--dec_hidden", type=int, default=1024)
    ap.add_argument("--dec_layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.tiny:
        small = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab": 256, "seq": 32, "micro": 2}
        small |= {"steps": 2, "offload_steps": 1, "warmup": 1, "dec_hidden": 64, "dec_layers": 2}
        small |= {"prompt": 8, "new": 8, "repeats": 1}
        for key, value in small.items():
            setattr(args, key, value)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out: dict[str, Any] = {"device": device, "torch": torch.__version__}
    out["optimizer"] = args.optimizer
    if args.only in ("train", "both"):
        out["train"] = train(args)
    if args.only in ("decode", "both"):
        out["decode"] = decode(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
