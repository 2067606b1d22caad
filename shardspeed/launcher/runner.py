"""The ``shardspeed`` command: DeepSpeed's launcher interface, from hostfile to running ranks.

``shardspeed [flags] script.py [script args]``. Without a hostfile the job runs on this machine
(all local GPUs, or ``--num_gpus N`` CPU ranks). With a hostfile of several hosts a backend
(``--launcher pdsh|openmpi|mvapich|mpich|impi|slurm``) starts it everywhere; with ``--no_ssh`` each
node runs ``shardspeed --node_rank K ...`` itself. No torch or runtime module is imported here.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from shardspeed.launcher import launch as node_launch
from shardspeed.launcher.backends import RUNNERS, LaunchPlan, get_runner
from shardspeed.launcher.backends.pdsh import PDSHRunner, is_exec_mode
from shardspeed.launcher.constants import (
    DEFAULT_HOSTFILE,
    DEFAULT_MASTER_PORT,
    LOCALHOST_ADDR,
    PDSH_LAUNCHER,
)
from shardspeed.launcher.env import collect_exports, env_file_names
from shardspeed.launcher.hostfile import HostfileError, fetch_hostfile, parse_hostfile_lines
from shardspeed.launcher.resources import (
    Resources,
    local_accelerator_count,
    parse_resource_filter,
    select_resources,
)
from shardspeed.launcher.supervisor import POLL_INTERVAL_S, StopRequest, forwarding_signals
from shardspeed.launcher.world_info import encode_world_info
from shardspeed.utils.logging import logger

# DeepSpeed's names here, which Accelerate and Transformers import: the env file the launcher
# reads (``DS_ENV_FILE`` renames it) and the folders searched for it, home first
DEEPSPEED_ENVIRONMENT_NAME = env_file_names()[0]
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "cli",
    "main",
    "parse_args",
    "parse_resource_filter",
]


def _parse_hostfile(hostfile_lines: list[str]) -> dict[str, int]:
    """DeepSpeed's name: ``{host: slots}`` from hostfile lines (``HostfileError`` when bad)."""
    return parse_hostfile_lines(hostfile_lines)


_INSTALL_HINTS = {
    "pdsh": "apt-get install pdsh",
    "mpirun": "apt-get install openmpi-bin (or your MPI's package)",
    "srun": "run inside a Slurm allocation",
}


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's launcher flags, same names and defaults."""
    p = argparse.ArgumentParser(
        prog="shardspeed",
        description="shardspeed launcher: run a training script on one or many nodes "
        "(DeepSpeed's `deepspeed` command).",
    )
    p.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help=f"'HOST slots=N' per line (default: {DEFAULT_HOSTFILE} if it exists)",
    )
    p.add_argument("-i", "--include", default="", help='hosts/slots to use: "w0@w1:0,2"')
    p.add_argument("-e", "--exclude", default="", help='hosts/slots to skip: "w1:0"')
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        dest="num_gpus",
        type=int,
        default=-1,
        help="slots per node (on CPU: number of local ranks)",
    )
    p.add_argument("--min_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_elastic_nodes", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument("--master_addr", default="", help="rank 0's address (default: first host)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank (with --no_ssh)")
    p.add_argument("--launcher", default=PDSH_LAUNCHER, help=f"one of {', '.join(RUNNERS)}")
    p.add_argument("--launcher_args", default="", help="extra arguments for the backend")
    p.add_argument("--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", action="store_true", help="run the program without python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank")
    p.add_argument("--no_ssh", action="store_true", help="each node is launched separately")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the ssh reachability test")
    p.add_argument("--force_multi", action="store_true", help="use the backend even for 1 node")
    p.add_argument("--save_pid", action="store_true", help="write pids to /tmp/<pid>.shardspeed")
    p.add_argument("--enable_each_rank_log", default="None", help="directory for per-rank logs")
    p.add_argument(
        "--autotuning",
        default="",
        choices=["tune", "run", ""],
        help="tune: search the config's autotuning space and write the best config; "
        "run: tune, then launch the job with it",
    )
    p.add_argument("--elastic_training", action="store_true", help="(not implemented yet)")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin each rank to cores")
    p.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. 0-3,8-11")
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", default=None, help="shell file sourced on each node (pdsh)")
    p.add_argument(
        "--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    p.add_argument("user_script", help="the training script (or program / module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def _join_launcher_args(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Turn ``--launcher_args "--mca x y"`` into ``--launcher_args=--mca x y``.

    argparse refuses a value that starts with ``-`` unless it is attached with ``=``, and backend
    flags always do; only the launcher's own flags (before the user script) are looked at.
    """
    takes_value = {
        opt for action in parser._actions if action.nargs is None for opt in action.option_strings
    }
    out = list(argv)
    i = 0
    while i < len(out):
        token = out[i]
        if token == "--launcher_args" and i + 1 < len(out):
            out[i : i + 2] = [f"--launcher_args={out[i + 1]}"]
        elif not token.startswith("-"):
            break  # the user script: everything after it belongs to the script
        elif token in takes_value:
            i += 1
        i += 1
    return out


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """Parse the launcher's command line (``sys.argv[1:]`` when ``args`` is None)."""
    parser = build_parser()
    argv = sys.argv[1:] if args is None else list(args)
    return parser.parse_args(args=_join_launcher_args(argv, parser))


def check_args(args: argparse.Namespace) -> None:
    """Reject flag combinations that cannot work, naming the fix."""
    if args.elastic_training:
        raise ValueError(
            "--elastic_training is not implemented in shardspeed yet; launch a fixed-size "
            "job (drop --elastic_training/--min_elastic_nodes/--max_elastic_nodes)"
        )
    if args.module and args.no_python:
        raise ValueError("--module and --no_python contradict each other; pass only one")
    if not 0 < args.master_port < 65536:
        raise ValueError(f"--master_port {args.master_port} is not a TCP port; use 1..65535")
    if args.launcher.lower() not in RUNNERS:
        raise ValueError(
            f"unknown --launcher {args.launcher!r}; choose one of {', '.join(RUNNERS)}"
        )
    if args.bind_core_list and not args.bind_cores_to_rank:
        raise ValueError("--bind_core_list needs --bind_cores_to_rank; add it or drop the list")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        limits = [
            f"--{n} {v}"
            for n, v in (("num_nodes", args.num_nodes), ("num_gpus", args.num_gpus))
            if v >= 0
        ]
        filters = [
            f"--{n} {v!r}" for n, v in (("include", args.include), ("exclude", args.exclude)) if v
        ]
        raise ValueError(
            f"{' '.join(limits)} cannot be combined with {' '.join(filters)} (as in DeepSpeed); "
            "pick the hosts and slots with --include/--exclude alone, or size the job with "
            "--num_nodes/--num_gpus alone"
        )


def resolve_resources(args: argparse.Namespace) -> tuple[Resources, bool]:
    """The active ``{host: slots}`` and whether the job came from a hostfile."""
    pool = fetch_hostfile(args.hostfile)
    if pool is not None:
        return select_resources(
            pool, args.include, args.exclude, args.num_nodes, args.num_gpus
        ), True
    if args.num_nodes > 1:
        raise ValueError(
            f"--num_nodes {args.num_nodes} needs a hostfile listing the nodes; pass "
            "-H/--hostfile with one 'HOST slots=N' line per node"
        )
    gpus = local_accelerator_count()
    if gpus is None:
        # on CPU --num_gpus is the number of local ranks, so it sizes the pool, not limits it
        pool = {"localhost": max(args.num_gpus, 1)}
        return select_resources(pool, args.include, args.exclude, args.num_nodes), False
    pool = {"localhost": gpus}
    return select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus), False


def launch_flags(args: argparse.Namespace) -> list[str]:
    """The node launcher's own options, as flags for ``shardspeed.launcher.launch``."""
    flags: list[str] = []
    if args.save_pid:
        flags.append(f"--save_pid={os.getpid()}")
    if args.enable_each_rank_log not in (None, "None"):
        flags.append(f"--enable_each_rank_log={os.path.abspath(args.enable_each_rank_log)}")
    if args.bind_cores_to_rank:
        flags.append("--bind_cores_to_rank")
    if args.bind_core_list:
        flags.append(f"--bind_core_list={args.bind_core_list}")
    return flags


def node_launch_argv(
    args: argparse.Namespace, resources: Resources, node_rank: int, master_addr: str
) -> list[str]:
    """Arguments for :func:`shardspeed.launcher.launch.main` on this machine."""
    argv = [
        f"--world_info={encode_world_info(resources)}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={args.master_port}",
        *launch_flags(args),
    ]
    argv += [
        flag
        for flag, on in (
            ("--module", args.module),
            ("--no_python", args.no_python),
            ("--no_local_rank", args.no_local_rank),
        )
        if on
    ]
    return argv + [args.user_script, *args.user_args]


def _no_ssh_node_rank(args: argparse.Namespace, resources: Resources) -> int:
    if len(resources) == 1:
        return max(args.node_rank, 0)
    if not 0 <= args.node_rank < len(resources):
        raise ValueError(
            f"--no_ssh with {len(resources)} nodes needs --node_rank 0..{len(resources) - 1} "
            "(this machine's line in the hostfile), and the same hostfile on every node"
        )
    return args.node_rank


def build_plan(args: argparse.Namespace, resources: Resources, master_addr: str) -> LaunchPlan:
    """The multi-node :class:`LaunchPlan` for these arguments."""
    return LaunchPlan(
        resources=resources,
        user_script=args.user_script,
        user_args=tuple(args.user_args),
        master_addr=master_addr,
        master_port=args.master_port,
        exports=collect_exports(),
        launcher_args=tuple(shlex.split(args.launcher_args)),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        launch_flags=tuple(launch_flags(args)),
        ssh_port=args.ssh_port,
        venv_script=args.venv_script,
        uses_gpus=local_accelerator_count() is not None,
    )


def check_ssh(host: str, port: int | None) -> None:
    """Fail early, with the fix, when ``host`` is not reachable by password-less ssh."""
    cmd = [
        "ssh",
        "-o",
        "PasswordAuthentication=no",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
    ]
    cmd += ["-p", str(port)] if port is not None else []
    try:
        result = subprocess.run([*cmd, host, "hostname"], capture_output=True, timeout=30)
        ok = result.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise ValueError(
            f"host {host!r} is not reachable by password-less ssh; set up ssh keys, use "
            "--no_ssh (launch every node yourself), or skip this test with --no_ssh_check"
        )


def run_backend(cmd: list[str], env: dict[str, str]) -> int:
    """Run the backend command in its own process group, forwarding signals to all of it."""
    stop = StopRequest()
    with forwarding_signals(stop):
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        forwarded = False
        while proc.poll() is None:
            if stop.signum is not None and not forwarded:
                try:
                    os.killpg(proc.pid, stop.signum)
                except ProcessLookupError:
                    pass  # it exited between poll() and here
                forwarded = True
            time.sleep(POLL_INTERVAL_S)
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def run(args: argparse.Namespace) -> int:
    """Launch the job described by parsed ``args``; returns the job's exit code."""
    check_args(args)
    resources, from_hostfile = resolve_resources(args)
    world = sum(len(s) for s in resources.values())
    logger.info(f"{world} rank(s) on {len(resources)} node(s): {resources}")
    if args.autotuning:
        from shardspeed.autotuning.autotuner import autotune  # imports torch only when tuning

        return autotune(args, resources)
    multi_node = args.force_multi or len(resources) > 1
    if args.no_ssh or not multi_node:
        node_rank = _no_ssh_node_rank(args, resources) if args.no_ssh else 0
        default_addr = next(iter(resources)) if from_hostfile and len(resources) > 1 else None
        master_addr = args.master_addr or default_addr or LOCALHOST_ADDR
        return node_launch.main(node_launch_argv(args, resources, node_rank, master_addr))
    runner = get_runner(args.launcher)
    if not runner.backend_exists():
        hint = _INSTALL_HINTS.get(runner.binary, f"install {runner.binary}")
        raise ValueError(
            f"--launcher {runner.name} needs `{runner.binary}` on PATH and it is not there; "
            f"{hint}, or pick another --launcher"
        )
    master_addr = args.master_addr or next(iter(resources))
    plan = runner.with_exports(build_plan(args, resources, master_addr))
    runner.validate(plan)
    if isinstance(runner, PDSHRunner):
        cmd = runner.get_cmd(plan, os.environ)
        if not args.no_ssh_check and not is_exec_mode(plan, os.environ):
            check_ssh(next(iter(resources)), args.ssh_port)
    else:
        cmd = runner.get_cmd(plan)
    logger.debug(f"launching with: {shlex.join(cmd)}")
    return run_backend(cmd, runner.get_env(plan, os.environ))


def main(args: list[str] | None = None) -> int:
    """Launch from a command line (``sys.argv[1:]`` when ``args`` is None) and return the job's
    exit code. As DeepSpeed's ``runner.main``, a bad command line raises (``ValueError``,
    :class:`~shardspeed.launcher.hostfile.HostfileError`) before anything starts; :func:`cli`
    reports those as a message instead. ``shardspeed serve ...`` runs the HTTP server instead
    of launching a script."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "serve":
        # imported here: the launcher itself must not pull in torch or the serving stack
        from shardspeed.inference.v2.serving.cli import main as serve_main

        return serve_main(argv[1:])
    parsed = parse_args(args)
    if parsed.quiet:
        logger.setLevel("WARNING")
    else:
        logger.setLevel(parsed.log_level.upper())
    return run(parsed)


def cli(args: list[str] | None = None) -> int:
    """Console entry point of ``shardspeed``: :func:`main`, with a bad command line reported as
    one error line and exit code 2 instead of a traceback."""
    try:
        return main(args)
    except (ValueError, HostfileError) as exc:
        logger.error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(cli())
