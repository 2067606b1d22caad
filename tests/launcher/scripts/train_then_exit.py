"""Train a few ZeRO-3 steps on gloo and end as the flags say; by default without destroying the
process groups, as most training scripts do.

- ``--own-group``: the script makes the world group itself (as a user or another framework may)
  before shardspeed sees it.
- ``--torch-destroy`` / ``--shardspeed-destroy``: the script destroys the groups at its end,
  through torch (which leaves shardspeed's caches holding them) or through shardspeed.
- ``--user-exit-handler``: an exit handler registered after importing shardspeed, before init,
  still uses the world group (a barrier), then destroys it: it must run before shardspeed's.

An exit handler registered before shardspeed is imported (so it runs last) prints the threads
the process still has: every gloo group must be freed by then, or gloo's threads are left to
interpreter shutdown, where they can abort the process."""

from __future__ import annotations

import atexit
import os
import sys


def _report_threads() -> None:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm_file:
                names.append(comm_file.read().strip())
        except OSError:  # the thread ended while we looked
            continue
    line = f"EXIT_THREADS rank={os.environ.get('RANK')} {','.join(sorted(names))}\n"
    os.write(1, line.encode())  # one write: the ranks share the launcher's stdout


atexit.register(_report_threads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardspeed  # noqa: E402
from shardspeed import comm  # noqa: E402


def _user_exit_handler() -> None:
    dist.barrier()
    dist.destroy_process_group()
    os.write(1, f"USER_EXIT_HANDLER_DONE rank={os.environ.get('RANK')}\n".encode())


def main() -> None:
    if "--user-exit-handler" in sys.argv:
        atexit.register(_user_exit_handler)
    if "--own-group" in sys.argv:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    for _ in range(2):
        loss = engine(torch.randn(2, 8)).square().mean()
        engine.backward(loss)
        engine.step()
    # imported after init, this binds the world group as a default argument of its __init__
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401

    # a group made through the registry, with a gloo reduce-scatter on it: both keep the
    # group in module-level caches (the registry, the send/recv tags, the node-crossing check)
    # (launched on 3 ranks: ranks 0 and 1 share a group that is not the world)
    pair = comm.mesh.groups_for([[0, 1], [2]])
    if comm.get_rank() < 2:
        out = torch.empty(2)
        comm.reduce_scatter_tensor(out, torch.ones(4), group=pair)
        assert out.tolist() == [2.0, 2.0], out
    # rank 2 makes its group of one through rank 0's store after the others have moved on
    comm.barrier()
    print(f"TRAINED rank={comm.get_rank()}", flush=True)
    if "--torch-destroy" in sys.argv:
        dist.destroy_process_group()
    if "--shardspeed-destroy" in sys.argv:
        comm.destroy_process_group()


if __name__ == "__main__":
    main()
