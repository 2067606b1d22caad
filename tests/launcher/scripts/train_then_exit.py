"""Train a few ZeRO-3 steps on gloo, then exit without destroying the process groups, as most
training scripts do (with ``--own-group`` the script makes the world group itself, as a user or
another framework may, before shardspeed sees it; with ``--torch-destroy`` it destroys the groups
through torch at the end, which leaves shardspeed's caches holding them). An exit handler registered before shardspeed's (so it runs after it) prints
the threads this process still has: shardspeed's handler must have freed every gloo group by then,
or gloo's threads are left to interpreter shutdown, where they can abort the process."""

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

import shardspeed  # noqa: E402
from shardspeed import comm  # noqa: E402


def main() -> None:
    if "--own-group" in sys.argv:
        import torch.distributed as dist

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
    # a group made through the registry, with a gloo reduce-scatter on it: both keep the
    # group in module-level caches (the registry, the send/recv tags, the node-crossing check)
    # (launched on 3 ranks: ranks 0 and 1 share a group that is not the world)
    pair = comm.mesh.groups_for([[0, 1], [2]])
    if comm.get_rank() < 2:
        out = torch.empty(2)
        comm.reduce_scatter_tensor(out, torch.ones(4), group=pair)
        assert out.tolist() == [2.0, 2.0], out
    print(f"TRAINED rank={comm.get_rank()}", flush=True)
    if "--torch-destroy" in sys.argv:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
