"""Run a benchmark script at ``--tiny`` sizes and return its one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def tiny_run(script: str, timeout: float, *args: str) -> dict[str, Any]:
    """``python benchmarks/<script> --tiny *args`` from the repository root: exit 0, last line
    JSON."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out
