"""What every multi-node backend shares: the launch plan (data in) and the runner interface.

A backend turns a :class:`LaunchPlan` into the argv of one local process (``pdsh``, ``mpirun``,
``srun``) that starts the whole job. Building the command is pure, so tests compare it as data.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from shardspeed.launcher.constants import DEFAULT_MASTER_PORT
from shardspeed.launcher.resources import Resources


@dataclass(frozen=True)
class LaunchPlan:
    """One job: where it runs, what it runs, and the settings every backend may need.

    ``launch_flags`` are the per-node launcher's own flags (``--save_pid``, core binding, rank
    logs); only backends that start ``shardspeed.launcher.launch`` on each node can honour them.
    """

    resources: Resources
    user_script: str
    user_args: tuple[str, ...] = ()
    master_addr: str = ""
    master_port: int = DEFAULT_MASTER_PORT
    exports: Mapping[str, str] = field(default_factory=dict)
    launcher_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    python: str = sys.executable
    cwd: str = field(default_factory=os.getcwd)
    launch_flags: tuple[str, ...] = ()
    ssh_port: int | None = None
    venv_script: str | None = None
    uses_gpus: bool = False

    @property
    def hosts(self) -> list[str]:
        return list(self.resources)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.resources.values())


#: one process's rank identity (torchrun's variables, which ``init_distributed`` also exports):
#: never handed to a backend, whose ranks learn theirs from it (MPI, Slurm) or from launch.py
RANK_IDENTITY = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
)


def launching_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without :data:`RANK_IDENTITY`: launched from inside a process that already has
    a rank (an in-process engine, an outer job), every rank of the new job would otherwise read
    that one identity and ignore the backend's (all of them rank 0 of a world of 1)."""
    return {k: v for k, v in environ.items() if k not in RANK_IDENTITY}


def rank_program(plan: LaunchPlan) -> list[str]:
    """The argv one rank runs: ``python -u [-m] script args`` or, with ``--no_python``, the program."""
    if plan.no_python:
        return [plan.user_script, *plan.user_args]
    module = ["-m"] if plan.module else []
    return [plan.python, "-u", *module, plan.user_script, *plan.user_args]


def rendezvous_env(plan: LaunchPlan) -> dict[str, str]:
    """The allowlisted exports plus ``MASTER_ADDR``/``MASTER_PORT`` for backends without launch.py."""
    env = dict(plan.exports)
    env["MASTER_ADDR"] = plan.master_addr
    env["MASTER_PORT"] = str(plan.master_port)
    return env


class MultiNodeRunner(ABC):
    """Builds and describes the command that starts a job on several nodes.

    ``MultiNodeRunner(args, world_info_base64)`` is DeepSpeed's constructor: the parsed launcher
    arguments and the encoded world info are kept as attributes (as are ``user_script`` and
    ``user_arguments``), and both may be left out: the command itself is built from a
    :class:`LaunchPlan`.
    """

    name: str = ""
    binary: str = ""

    def __init__(
        self, args: argparse.Namespace | None = None, world_info_base64: str | None = None
    ) -> None:
        self.args = args
        self.world_info_base64 = world_info_base64
        self.user_script: str | None = getattr(args, "user_script", None)
        self.user_arguments: list[str] = list(getattr(args, "user_args", None) or [])
        self.exports: dict[str, str] = {}
        """Variables added with :meth:`add_export`, exported to every rank (DeepSpeed's API)."""

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every rank of jobs this runner starts (surrounding spaces go)."""
        self.exports[key.strip()] = var.strip()

    def with_exports(self, plan: LaunchPlan) -> LaunchPlan:
        """``plan`` with this runner's :meth:`add_export` variables added (they win)."""
        if not self.exports:
            return plan
        return replace(plan, exports={**plan.exports, **self.exports})

    def backend_exists(self) -> bool:
        """Whether this backend's program is on ``PATH``."""
        return shutil.which(self.binary) is not None

    def validate(self, plan: LaunchPlan) -> None:
        """Raise ``ValueError`` when the plan asks for something this backend cannot do."""
        if plan.launch_flags:
            raise ValueError(
                f"--launcher {self.name} starts every rank itself, so the per-node options "
                f"{' '.join(f for f in plan.launch_flags if f.startswith('--'))} cannot apply; "
                "drop them or use --launcher pdsh / --no_ssh"
            )
        if plan.venv_script:
            raise ValueError(
                f"--venv_script is only supported with --launcher pdsh; with {self.name}, "
                "activate the environment in your job script instead"
            )

    @abstractmethod
    def get_cmd(self, plan: LaunchPlan) -> list[str]:
        """The argv that starts the whole job."""

    def get_env(self, plan: LaunchPlan, environ: Mapping[str, str]) -> dict[str, str]:
        """The environment of the backend process itself: the launching machine's, less any
        rank identity it carries (:func:`launching_env`)."""
        return launching_env(environ)


class PooledRunner(MultiNodeRunner):
    """A backend DeepSpeed constructs with the hostfile's pool too (the MPI runners and Slurm):
    ``Runner(args, world_info_base64, resource_pool)``, ``resource_pool`` being ``{host: slot
    count}``; kept as an attribute."""

    def __init__(
        self,
        args: argparse.Namespace | None = None,
        world_info_base64: str | None = None,
        resource_pool: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = dict(resource_pool or {})


def require_prefix_slots(plan: LaunchPlan, name: str) -> None:
    """MPI-style backends place ranks by count; slot ids other than ``0..n-1`` cannot be honoured."""
    for host, slots in plan.resources.items():
        if slots != list(range(len(slots))):
            raise ValueError(
                f"--launcher {name} places ranks by count and cannot use slots {slots} on host "
                f"{host!r}; select slots 0..n-1 (e.g. --num_gpus n) or use --launcher pdsh"
            )


def uniform_slots_per_node(plan: LaunchPlan, name: str) -> int:
    """The common slot count per host; ``-ppn`` style backends need every host to have the same."""
    counts = {len(slots) for slots in plan.resources.values()}
    if len(counts) != 1:
        detail = ", ".join(f"{h}={len(s)}" for h, s in plan.resources.items())
        raise ValueError(
            f"--launcher {name} needs the same number of slots on every host (got {detail}); "
            "use --num_gpus to even them out"
        )
    return counts.pop()
