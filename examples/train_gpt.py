"""Train a small GPT on synthetic tokens with shardspeed, exactly as one would with DeepSpeed.

shardspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/gpt_config.json

With ``--save_dir D`` it saves a checkpoint at the end; with ``--resume`` it first loads the
newest one from D, which may have been saved by another number of ranks or ZeRO stage:

shardspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/gpt_config.json --save_dir ckpt
shardspeed --num_gpus 1 examples/train_gpt.py --deepspeed_config examples/gpt_config.json --save_dir ckpt --resume

With ``--moe_experts N`` every other block's feed-forward is a Mixture of Experts of N experts,
split over ``--ep_size`` ranks (expert parallelism):

shardspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/gpt_config.json --moe_experts 4 --ep_size 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # examples.gpt_moe_model

from gpt_model import GPT, GPTConfig, synthetic_tokens  # noqa: E402

import shardspeed as deepspeed  # noqa: E402 - the one-line switch from DeepSpeed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to run")
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--moe_experts", type=int, default=0, help="MoE feed-forwards (0: none)")
    parser.add_argument("--ep_size", type=int, default=1, help="ranks the experts are split over")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--resume", action="store_true", help="first load the newest checkpoint")
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def _moe_model(cfg: GPTConfig, args: argparse.Namespace) -> torch.nn.Module:
    from examples.gpt_moe_model import GPTMoE, MoEConfig

    return GPTMoE(cfg, MoEConfig(num_experts=args.moe_experts, ep_size=args.ep_size, k=2))


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd)
    model = GPT(cfg) if not args.moe_experts else _moe_model(cfg, args)
    engine, _, loader, _ = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=model.parameters(),
        training_data=synthetic_tokens(4096, cfg, seed=args.seed),
    )
    batches = deepspeed.utils.RepeatingLoader(loader)
    rank = deepspeed.comm.get_rank()
    if rank == 0:  # what the config (or `shardspeed --autotuning run`) chose
        print(
            f"micro-batch {engine.train_micro_batch_size_per_gpu()}, accumulation "
            f"{engine.gradient_accumulation_steps()}, ZeRO stage {engine.zero_optimization_stage()}",
            flush=True,
        )
    if args.resume:
        path, _ = engine.load_checkpoint(args.save_dir)
        if rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    first_loss = last_loss = float("nan")
    start = engine.global_steps  # a resumed run counts on from the checkpoint's step
    for step in range(start + 1, start + args.steps + 1):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens, targets = (t.to(engine.device) for t in next(batches))
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
        last_loss = loss.item()
        if step == start + 1:
            first_loss = last_loss
        if rank == 0 and (step % 10 == 0 or step == start + 1):
            print(f"step {step:4d}  loss {last_loss:.4f}  lr {engine.get_lr()[0]:.2e}", flush=True)
    if rank == 0:
        print(f"done: {args.steps} steps, loss {first_loss:.4f} -> {last_loss:.4f}", flush=True)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
        if rank == 0:
            print(f"saved {args.save_dir}/global_step{engine.global_steps}", flush=True)


if __name__ == "__main__":
    main()
