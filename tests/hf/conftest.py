"""Helpers for the Hugging Face tests: the ``deepspeed`` compatibility package installed into a
scratch folder (so Transformers and Accelerate find a ``deepspeed`` distribution), an
environment for launched ranks, and the three launchers' command lines.

Everything runs on CPU with gloo, from models built from a config: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def compat_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the installed ``deepspeed`` compatibility package (code + metadata)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not available to this Python")
    scratch = tmp_path_factory.mktemp("hf-compat")
    source = scratch / "src"
    shutil.copytree(REPO / "compat" / "deepspeed", source)
    site = scratch / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install",
         "--no-build-isolation", "--no-deps", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return site


def rank_env(site: Path, **extra: str) -> dict[str, str]:
    """This environment for launched ranks: the compatibility package and the repository
    importable, CPU accelerator, one thread per rank, Hugging Face offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(REPO), env.get("PYTHONPATH")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for key in [
        k for k in env if k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))
    ]:
        env.pop(key)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def launch_cmd(launcher: str, script: str, *args: str, ds_config: Path | None = None) -> list[str]:
    """``launcher`` (shardspeed, torchrun or accelerate) starting 2 ranks of ``script``."""
    target = [str(SCRIPTS / script), *args]
    port = str(free_port())
    if launcher == "shardspeed":
        return [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", "2",
                "--master_port", port, *target]  # fmt: skip
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", port, *target]  # fmt: skip
    if launcher == "accelerate":
        # --use_deepspeed makes accelerate launch set up DeepSpeed's environment; on CPU it
        # needs no other flag (the script names gloo itself, see scripts/hf_common.py)
        assert ds_config is not None
        return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
                "--num_machines", "1", "--main_process_port", port, "--mixed_precision", "no",
                "--dynamo_backend", "no", "--use_deepspeed",
                "--deepspeed_config_file", str(ds_config), *target]  # fmt: skip
    raise ValueError(launcher)


def run_launched(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{output[-6000:]}"
    return output


def run_plain(script: str, *args: str, env: dict[str, str], timeout: float = 60) -> Any:
    """Run ``script`` in one plain process (no launcher) and parse its last output line."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
