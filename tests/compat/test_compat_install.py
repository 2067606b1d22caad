"""Installing and uninstalling the ``deepspeed`` compatibility package in a fresh venv.

The venv sees the running interpreter's packages (torch, shardspeed) through a ``.pth`` file that
adds this environment's site-packages, whether that environment is the system Python or itself a
venv (``--system-site-packages`` would see only the base interpreter's), and the package is
installed offline (``--no-build-isolation --no-deps``) from a copy of ``compat/deepspeed``.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.metadata, importlib.util, json
from packaging.specifiers import SpecifierSet
from packaging.version import Version
import deepspeed, deepspeed.comm, deepspeed.runtime.engine
import shardspeed, shardspeed.comm, shardspeed.runtime.engine
meta = importlib.metadata.metadata("deepspeed")
print(json.dumps({
    "same_engine": deepspeed.runtime.engine.DeepSpeedEngine
        is shardspeed.runtime.engine.DeepSpeedEngine,
    "same_comm": deepspeed.comm is shardspeed.comm,
    "found": importlib.util.find_spec("deepspeed") is not None,
    "version": deepspeed.__version__,
    "dist_version": meta["Version"],
    "summary": meta["Summary"],
    "hf_check": Version(meta["Version"]) in SpecifierSet(">=0.9.3"),
}))
"""


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _make_venv(venv: Path) -> Path:
    """A venv without pip whose Python also sees this environment's site-packages (after its own)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    own = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=venv)
    parents = [d for d in site.getsitepackages() if Path(d).is_dir()]
    # addsitedir (not a bare path line) so the parent's own .pth files, such as an editable
    # install's finder, are processed too.
    lines = [f"import site; site.addsitedir({d!r})" for d in parents]
    (Path(own.strip()) / "parent_env.pth").write_text("\n".join(lines) + "\n")
    return python


def _answer(python: Path, cwd: Path) -> dict:
    report = json.loads(_run(python, "-m", "shardspeed.env_report", "--json", cwd=cwd))
    return report["deepspeed_import"]


@pytest.mark.timeout(120)
def test_install_then_uninstall(tmp_path: Path) -> None:
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not available to this Python")
    venv = tmp_path / "venv"
    python, bindir = _make_venv(venv), venv / "bin"
    work = tmp_path / "work"  # not the repository: nothing there shadows an installed package
    work.mkdir()
    assert _answer(python, work)["answer"] == "none"

    source = tmp_path / "compat-src"
    shutil.copytree(REPO / "compat" / "deepspeed", source)
    pip = (python, "-m", "pip", "--disable-pip-version-check", "-q")
    _run(*pip, "install", "--no-build-isolation", "--no-deps", source, cwd=work)

    probe = json.loads(_run(python, "-c", PROBE, cwd=work))
    assert probe["same_engine"] and probe["same_comm"] and probe["found"]
    assert probe["version"] == probe["dist_version"]
    assert "+shardspeed." in probe["version"] and probe["hf_check"]
    assert "REPLACES a deepspeed install" in probe["summary"]
    assert "usage: " in _run(bindir / "deepspeed", "--help", cwd=work)
    ds_report = json.loads(_run(bindir / "ds_report", "--json", cwd=work))
    assert ds_report["deepspeed_import"]["answer"] == "shardspeed-compat"
    debug = {**os.environ, "SHARDSPEED_LOG_LEVEL": "debug"}
    twice = (
        "import deepspeed, importlib; import deepspeed.comm; importlib.import_module('deepspeed')"
    )
    logged = _run(python, "-c", twice, cwd=work, env=debug)
    assert logged.count("answered by the shardspeed compatibility package") == 1
    after = _answer(python, work)
    assert after["answer"] == "shardspeed-compat"
    assert after["version"] == probe["version"]

    _run(*pip, "uninstall", "-y", "deepspeed", cwd=work)
    assert _answer(python, work)["answer"] == "none"
    assert not (bindir / "deepspeed").exists()
    version = _run(python, "-c", "import shardspeed; print(shardspeed.__version__)", cwd=work)
    assert version.strip()
    assert "usage: " in _run(python, "-m", "shardspeed.launcher.runner", "--help", cwd=work)
