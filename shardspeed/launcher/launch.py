"""The per-node launcher: start this node's ranks, watch them, and fail fast.

``python -m shardspeed.launcher.launch --world_info=<b64> --node_rank=N --master_addr=A
--master_port=P [options] script [script args]`` starts one process per slot of node ``N`` with
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``/``LOCAL_SIZE``,
``CROSS_RANK``/``CROSS_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and ``--local_rank=<n>``
appended unless ``--no_local_rank``. When any rank exits non-zero or is killed, the others are
terminated within about a second and the launcher exits with that rank's code.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from shardspeed.launcher.binding import available_cores, parse_core_list, split_cores
from shardspeed.launcher.constants import (
    DEFAULT_MASTER_PORT,
    LOCALHOST_ADDR,
    PID_FILE_DIR,
    PID_FILE_SUFFIX,
)
from shardspeed.launcher.rank_errors import RankStderr
from shardspeed.launcher.resources import Resources, local_accelerator_count
from shardspeed.launcher.supervisor import (
    RankProcess,
    StopRequest,
    child_setup,
    forwarding_signals,
    supervise,
    terminate,
)
from shardspeed.launcher.world_info import decode_world_info
from shardspeed.utils.logging import logger


def build_parser() -> argparse.ArgumentParser:
    """The node launcher's flags (the runner writes them; users rarely call this directly)."""
    parser = argparse.ArgumentParser(
        prog="python -m shardspeed.launcher.launch",
        description="shardspeed per-node launcher: starts and supervises this node's ranks.",
    )
    parser.add_argument("--world_info", required=True, help="base64 host -> slots map")
    parser.add_argument("--node_rank", type=int, default=0, help="this node's index in world_info")
    parser.add_argument("--master_addr", default=LOCALHOST_ADDR, help="rank 0's address")
    parser.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    parser.add_argument("--module", action="store_true", help="run the script as python -m")
    parser.add_argument("--no_python", action="store_true", help="run the program directly")
    parser.add_argument("--no_local_rank", action="store_true", help="omit --local_rank=<n>")
    parser.add_argument("--save_pid", type=int, default=0, help="write pids to /tmp/<N>.shardspeed")
    parser.add_argument("--enable_each_rank_log", default="None", help="directory of rank logs")
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list", default=None, help="cores to split, e.g. 0-3,8-11")
    parser.add_argument("--enable_elastic_training", action="store_true")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1)
    parser.add_argument("--max_elastic_nodes", type=int, default=-1)
    parser.add_argument("training_script", help="the program every rank runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


@dataclass(frozen=True)
class NodeLayout:
    """Where this node sits in the job: its slots and the global rank of its first one."""

    node_rank: int
    num_nodes: int
    slots: list[int]
    first_rank: int
    world_size: int


def node_layout(world_info: Resources, node_rank: int) -> NodeLayout:
    """This node's layout; ``ValueError`` when ``node_rank`` is outside the job."""
    hosts = list(world_info)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(
            f"--node_rank {node_rank} is outside the job's {len(hosts)} node(s) "
            f"({', '.join(hosts)}); use 0..{len(hosts) - 1}"
        )
    first = sum(len(world_info[h]) for h in hosts[:node_rank])
    world = sum(len(s) for s in world_info.values())
    return NodeLayout(node_rank, len(hosts), list(world_info[hosts[node_rank]]), first, world)


def visible_devices(slots: list[int], current: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``slots``, read as indices into an existing setting if any."""
    if current:
        ids = [v.strip() for v in current.split(",") if v.strip()]
        if all(slot < len(ids) for slot in slots):
            return ",".join(ids[slot] for slot in slots)
    return ",".join(str(slot) for slot in slots)


def rank_env(
    base: dict[str, str], layout: NodeLayout, local_rank: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """The environment of one rank: the node's, plus the rank variables."""
    env = dict(base)
    env.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(layout.world_size),
        RANK=str(layout.first_rank + local_rank),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(len(layout.slots)),
        LOCAL_SIZE=str(len(layout.slots)),
        CROSS_RANK=str(layout.node_rank),
        CROSS_SIZE=str(layout.num_nodes),
    )
    return env


def rank_command(args: argparse.Namespace, local_rank: int) -> list[str]:
    """The argv of one rank."""
    if args.no_python:
        cmd = [args.training_script]
    else:
        cmd = [sys.executable, "-u", *(["-m"] if args.module else []), args.training_script]
    if not args.no_local_rank:
        cmd.append(f"--local_rank={local_rank}")
    return cmd + list(args.training_script_args)


def _core_blocks(args: argparse.Namespace, num_ranks: int) -> list[list[int] | None]:
    if not args.bind_cores_to_rank:
        return [None] * num_ranks
    cores = parse_core_list(args.bind_core_list) if args.bind_core_list else available_cores()
    return list(split_cores(cores, num_ranks))


def _check_args(args: argparse.Namespace) -> None:
    if args.enable_elastic_training:
        raise ValueError(
            "elastic training is not implemented in shardspeed yet; drop "
            "--elastic_training/--enable_elastic_training and launch a fixed-size job"
        )
    if args.module and args.no_python:
        raise ValueError("--module and --no_python contradict each other; pass only one")


def spawn_ranks(args: argparse.Namespace, layout: NodeLayout) -> list[RankProcess]:
    """Start one process per local slot (with its log file and core block when asked)."""
    base = dict(os.environ)
    if local_accelerator_count() is not None:
        base["CUDA_VISIBLE_DEVICES"] = visible_devices(
            layout.slots, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    blocks = _core_blocks(args, len(layout.slots))
    log_dir = None if args.enable_each_rank_log in (None, "None") else args.enable_each_rank_log
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d%H%M%S")
    ranks: list[RankProcess] = []
    for local_rank in range(len(layout.slots)):
        env = rank_env(base, layout, local_rank, args.master_addr, args.master_port)
        cores = blocks[local_rank]
        if cores:
            # torch sizes its thread pool from this; more threads than cores only thrash
            env["OMP_NUM_THREADS"] = str(len(cores))
        rank = int(env["RANK"])
        log = open(os.path.join(log_dir, f"{stamp}_rank{rank}.log"), "wb") if log_dir else None
        try:
            popen = subprocess.Popen(
                rank_command(args, local_rank),
                env=env,
                stdout=log,
                # without a log file, stderr comes through the launcher: tracebacks are told
                # once for all ranks (rank_errors.py)
                stderr=subprocess.STDOUT if log else subprocess.PIPE,
                start_new_session=True,
                preexec_fn=child_setup(cores),
            )
        except BaseException:
            if log is not None:
                log.close()
            terminate(ranks)
            raise
        pump = None if popen.stderr is None else RankStderr(rank, popen.stderr)
        ranks.append(RankProcess(rank, local_rank, popen, log, pump))
        logger.debug(f"started rank {rank}: pid {popen.pid}")
    return ranks


def _write_pid_file(save_pid: int, ranks: list[RankProcess]) -> str | None:
    if not save_pid:
        return None
    path = os.path.join(PID_FILE_DIR, f"{save_pid}{PID_FILE_SUFFIX}")
    # Written aside and renamed: whoever polls for the file never reads it half-written.
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        handle.write(f"{os.getpid()}\n{','.join(str(r.popen.pid) for r in ranks)}\n")
    os.replace(path + ".tmp", path)
    return path


def launch(args: argparse.Namespace) -> int:
    """Run this node's share of the job; the exit code is 0 or the first failing rank's."""
    _check_args(args)
    layout = node_layout(decode_world_info(args.world_info), args.node_rank)
    stop = StopRequest()
    with forwarding_signals(stop):
        ranks = spawn_ranks(args, layout)
        pid_file = _write_pid_file(args.save_pid, ranks)
        try:
            return supervise(ranks, stop)
        finally:
            terminate([r for r in ranks if r.popen.poll() is None])
            if pid_file is not None and os.path.exists(pid_file):
                os.remove(pid_file)


def main(argv: list[str] | None = None) -> int:
    """Console entry: parse the node launcher's flags and run :func:`launch`."""
    args = build_parser().parse_args(argv)
    try:
        return launch(args)
    except ValueError as exc:
        logger.error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
