"""``pdsh``: run the per-node launcher on every host at once, each learning its node rank from ``%n``.

Over ssh (the default) pdsh sends one command string to each host's shell. With ``-R exec`` (pdsh's
local "remote" mode, handy for tests and containers) it executes argv directly, so the same script
is wrapped in ``sh -c``. pdsh rewrites ``%h``, ``%u`` and ``%n`` everywhere in the command, so
every ``%`` that comes from the user is doubled.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from shardspeed.launcher.backends.base import LaunchPlan, MultiNodeRunner
from shardspeed.launcher.constants import PDSH_LAUNCHER
from shardspeed.launcher.env import shell_exports
from shardspeed.launcher.world_info import encode_world_info

PDSH_MAX_FAN_OUT = 1024


def _escape(text: str) -> str:
    return text.replace("%", "%%")


def is_exec_mode(plan: LaunchPlan, environ: Mapping[str, str]) -> bool:
    """Whether pdsh will run with ``-R exec`` (from the launcher args or ``PDSH_RCMD_TYPE``)."""
    args = list(plan.launcher_args)
    for i, arg in enumerate(args):
        if arg == "-R" and i + 1 < len(args):
            return args[i + 1] == "exec"
        if arg.startswith("-R") and len(arg) > 2:
            return arg[2:] == "exec"
    return environ.get("PDSH_RCMD_TYPE") == "exec"


class PDSHRunner(MultiNodeRunner):
    """``pdsh -S -f 1024 -w h1,h2 <script>``, where the script runs ``shardspeed.launcher.launch``."""

    name = PDSH_LAUNCHER
    binary = "pdsh"

    def validate(self, plan: LaunchPlan) -> None:
        """pdsh runs the node launcher, so every per-node option is supported."""

    def remote_script(self, plan: LaunchPlan) -> str:
        """The shell text every node runs (``%n`` left for pdsh to fill in with the node rank)."""
        launch = [
            plan.python,
            "-u",
            "-m",
            "shardspeed.launcher.launch",
            f"--world_info={encode_world_info(plan.resources)}",
            f"--master_addr={plan.master_addr}",
            f"--master_port={plan.master_port}",
            *plan.launch_flags,
        ]
        if plan.module:
            launch.append("--module")
        if plan.no_python:
            launch.append("--no_python")
        if plan.no_local_rank:
            launch.append("--no_local_rank")
        launch = [_escape(token) for token in launch]
        # the node rank is the one token pdsh must rewrite, so it alone is not escaped
        launch.append("--node_rank=%n")
        launch += [_escape(token) for token in (plan.user_script, *plan.user_args)]
        parts = [_escape(shell_exports(plan.exports))]
        if plan.venv_script:
            parts.append(f". {shlex.quote(_escape(plan.venv_script))}; ")
        parts.append(f"cd {shlex.quote(_escape(plan.cwd))}; ")
        parts.append(shlex.join(launch))
        return "".join(parts)

    def get_cmd(self, plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> list[str]:
        """The pdsh argv; ``environ`` (default: none) decides exec vs ssh mode with the flags."""
        script = self.remote_script(plan)
        remote = ["sh", "-c", script] if is_exec_mode(plan, environ or {}) else [script]
        hosts = ",".join(plan.hosts)
        return [
            "pdsh",
            "-S",
            "-f",
            str(PDSH_MAX_FAN_OUT),
            "-w",
            hosts,
            *plan.launcher_args,
            *remote,
        ]

    def get_env(self, plan: LaunchPlan, environ: Mapping[str, str]) -> dict[str, str]:
        """ssh by default (pdsh's own default may be rsh), and ``--ssh_port`` passed to ssh."""
        env = super().get_env(plan, environ)
        env.setdefault("PDSH_RCMD_TYPE", "ssh")
        if plan.ssh_port is not None:
            extra = env.get("PDSH_SSH_ARGS_APPEND", "")
            env["PDSH_SSH_ARGS_APPEND"] = f"{extra} -p {plan.ssh_port}".strip()
        return env
