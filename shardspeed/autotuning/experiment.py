"""One experiment: a real launch of the user's script through ``shardspeed``'s launcher.

Each experiment gets a folder ``exps_dir/<name>/`` with its config (``ds_config.json``), the
command (``cmd.txt``), the ranks' output (``stdout.log``, ``stderr.log``), the metric file the
engine writes (``metrics.json``) and the outcome (``result.json``). A failed launch never stops
the search: it is recorded with its cause (``oom``, ``error``, ``timeout``). When ``result.json``
already exists (a resumed tune with ``overwrite: false``) the experiment is not launched again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ExperimentResult", "launcher_argv", "run_experiment"]

# what a rank prints when its device runs out of memory (CUDA, the CPU allocator, torch's class)
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "cannot allocate memory", "memoryerror")


@dataclass
class ExperimentResult:
    """The outcome of one experiment."""

    name: str
    status: str  # "ok", "oom", "error" or "timeout"
    metrics: dict[str, float] = field(default_factory=dict)
    cause: str = ""
    seconds: float = 0.0
    resumed: bool = False

    def value(self, metric: str) -> float | None:
        """The tuned metric when the experiment succeeded."""
        return self.metrics.get(metric) if self.status == "ok" else None


def launcher_argv(args: argparse.Namespace) -> list[str]:
    """The launcher's own flags from the parsed command line (without ``--autotuning``)."""
    out: list[str] = []
    for name in ("hostfile", "include", "exclude", "master_addr", "launcher_args"):
        value = getattr(args, name, None)
        if value:
            out.append(f"--{name}={value}")
    for name in ("num_nodes", "num_gpus"):
        value = getattr(args, name, -1)
        if value is not None and value >= 0:
            out.append(f"--{name}={value}")
    if getattr(args, "launcher", None):
        out.append(f"--launcher={args.launcher}")
    for name in ("module", "no_python", "no_local_rank", "no_ssh", "no_ssh_check", "force_multi"):
        if getattr(args, name, False):
            out.append(f"--{name}")
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cause(returncode: int, exp_dir: str) -> tuple[str, str]:
    text = ""
    for log in ("stdout.log", "stderr.log"):  # the launcher logs to stdout, ranks to both
        try:
            with open(os.path.join(exp_dir, log), errors="replace") as fd:
                text += fd.read()
        except OSError:
            pass
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lowered = text.lower()
    if any(marker in lowered for marker in _OOM_MARKERS):
        hit = next((ln for ln in lines if any(m in ln.lower() for m in _OOM_MARKERS)), "")
        return "oom", hit[-300:]
    # the launcher's summary of a failed rank, else the last exception line, else the last line
    summary = [ln.split(" failed: ", 1)[1] for ln in lines if re.search(r"rank \d+ failed: ", ln)]
    raised = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", ln)]
    last = (summary or raised or lines or [""])[-1][-300:]
    return "error", f"exit code {returncode}: {last}" if last else f"exit code {returncode}"


def load_result(exp_dir: str) -> ExperimentResult | None:
    """The recorded outcome in ``exp_dir`` (None when it never finished)."""
    path = os.path.join(exp_dir, "result.json")
    if not os.path.isfile(path):
        return None
    with open(path) as fd:
        data = json.load(fd)
    result = ExperimentResult(**data)
    result.resumed = True
    return result


def run_experiment(
    name: str,
    exp_dir: str,
    config: dict[str, Any],
    launcher_flags: list[str],
    user_script: str,
    user_args: list[str],
    timeout_s: float,
) -> ExperimentResult:
    """Launch one experiment (or reuse its recorded result) and return its outcome.

    ``config`` must already name ``exp_dir/metrics.json`` as its metric (or model-info) path,
    and ``user_args`` must already point at ``exp_dir/ds_config.json``.
    """
    previous = load_result(exp_dir)
    if previous is not None:
        return previous
    os.makedirs(exp_dir, exist_ok=True)
    with open(os.path.join(exp_dir, "ds_config.json"), "w") as fd:
        json.dump(config, fd, indent=2)
    cmd = [
        sys.executable,
        "-m",
        "shardspeed.launcher.runner",
        *launcher_flags,
        f"--master_port={_free_port()}",
        user_script,
        *user_args,
    ]
    with open(os.path.join(exp_dir, "cmd.txt"), "w") as fd:
        fd.write(" ".join(cmd) + "\n")
    metric_path = os.path.join(exp_dir, "metrics.json")
    stderr_path = os.path.join(exp_dir, "stderr.log")
    start = time.perf_counter()
    with (
        open(os.path.join(exp_dir, "stdout.log"), "w") as out,
        open(stderr_path, "w") as err,
    ):
        # its own session, so a timeout ends the launcher and every rank it started
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = -1
            _stop(proc)
        except BaseException:
            _stop(proc)  # Ctrl-C or a signal on the tuner: its own session would outlive it
            raise
    seconds = time.perf_counter() - start
    if timed_out:
        result = ExperimentResult(name, "timeout", cause=f"no metric after {timeout_s:.0f} s")
    elif os.path.isfile(metric_path):
        with open(metric_path) as fd:
            result = ExperimentResult(name, "ok", metrics=json.load(fd))
    else:
        status, cause = _cause(returncode, exp_dir)
        if returncode == 0:
            cause = "the script ended before end_profile_step (give it more steps)"
        result = ExperimentResult(name, status, cause=cause)
    result.seconds = seconds
    with open(os.path.join(exp_dir, "result.json"), "w") as fd:
        json.dump({k: v for k, v in asdict(result).items() if k != "resumed"}, fd, indent=2)
    return result


def _stop(proc: subprocess.Popen[Any]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
