"""A tiny data-parallel training loop for launcher tests: gloo, hand-rolled gradient all-reduce.

Every rank fits ``y = 3x + 1`` on its own shard of synthetic data, averages gradients with
``all_reduce`` each step, and at the end checks all ranks hold the same weights. It prints
``TRAIN_OK rank=R world=W`` on success. ``--pid_dir`` makes each rank write ``rank<R>.pid`` once
the process group is up, so a test knows when training is under way; ``--sleep`` slows steps.
Rank discovery prefers ``shardspeed.comm.init_distributed`` and falls back to the launcher's and
MPI's environment variables while that module is not available.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_RANK_VARS = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def init() -> None:
    """Join the process group through shardspeed.comm when it exists, else from the env."""
    try:
        from shardspeed.comm import init_distributed
    except ImportError:
        init_distributed = None
    if init_distributed is not None:
        init_distributed(dist_backend="gloo")
        return
    for rank_var, size_var, local_var in _RANK_VARS:
        if rank_var in os.environ and size_var in os.environ:
            os.environ["RANK"] = os.environ[rank_var]
            os.environ["WORLD_SIZE"] = os.environ[size_var]
            os.environ["LOCAL_RANK"] = os.environ.get(local_var, "0")
            break
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--pid_dir", default="")
    parser.add_argument("--fail_rank", type=int, default=-1, help="this rank exits 3 at step 1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.pid_dir:
        pid_file = os.path.join(args.pid_dir, f"rank{rank}.pid")
        with open(pid_file + ".tmp", "w") as handle:  # renamed: readers never see it half-written
            handle.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
    torch.manual_seed(1234 + rank)
    weight = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for step in range(args.steps):
        if step == 1 and rank == args.fail_rank:
            print(f"rank {rank} failing on purpose", flush=True)
            return 3
        x = torch.randn(16)
        y = 3 * x + 1
        loss = ((weight[0] * x + weight[1] - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        dist.all_reduce(weight.grad)
        weight.grad /= world
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.sleep)
    spread = weight.detach().clone()
    low, high = spread.clone(), spread.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        print(f"rank {rank}: weights differ across ranks: {low} vs {high}", flush=True)
        return 1
    print(f"TRAIN_OK rank={rank} world={world} local_rank={args.local_rank}", flush=True)
    dist.barrier()
    # gloo's teardown sometimes aborts ("terminate called without an active exception") when
    # the peer that hosts the store leaves first; this script tests the launcher, not teardown
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
