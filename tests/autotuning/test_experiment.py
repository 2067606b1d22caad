"""One experiment through the real launcher, with scripts that fail in each way: the cause is
recorded (OOM, error, timeout) and a recorded experiment is not launched again."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from shardspeed.autotuning.experiment import launcher_argv, run_experiment

SCRIPTS = {
    "oom": "import sys\nsys.stderr.write('torch.OutOfMemoryError: CUDA out of memory.\\n')\n"
    "sys.exit(1)\n",
    "error": "raise KeyError('no_such_column')\n",
    "timeout": "import time\ntime.sleep(60)\n",
    "short": "print('finished early')\n",
    "ok": "import json, sys\n"
    "cfg = json.load(open(sys.argv[sys.argv.index('--deepspeed_config') + 1]))\n"
    "json.dump({'throughput': 5.0, 'latency': 0.2, 'flops': 1.0}, "
    "open(cfg['autotuning']['metric_path'], 'w'))\n",
}


def _run(tmp_path: Path, kind: str, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    script = tmp_path / f"{kind}.py"
    script.write_text(SCRIPTS[kind])
    exp_dir = tmp_path / "exps" / kind
    config = {"autotuning": {"enabled": True, "metric_path": str(exp_dir / "metrics.json")}}
    args = ["--deepspeed_config", str(exp_dir / "ds_config.json")]
    flags = ["--num_gpus=1", "--no_local_rank"]
    return run_experiment(kind, str(exp_dir), config, flags, str(script), args, timeout_s)


@pytest.mark.timeout(120)
def test_failures_are_recorded_with_their_cause(tmp_path: Path) -> None:
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    oom = _run(tmp_path, "oom")
    assert oom.status == "oom" and "out of memory" in oom.cause and oom.value("throughput") is None
    error = _run(tmp_path, "error")
    assert error.status == "error" and "KeyError: 'no_such_column'" in error.cause
    short = _run(tmp_path, "short")
    assert short.status == "error" and "before end_profile_step" in short.cause
    slow = _run(tmp_path, "timeout", timeout_s=3.0)
    assert slow.status == "timeout" and slow.seconds < 30
    ok = _run(tmp_path, "ok")
    assert ok.status == "ok" and ok.value("throughput") == 5.0
    recorded = json.loads((tmp_path / "exps" / "ok" / "result.json").read_text())
    assert recorded["status"] == "ok" and recorded["metrics"]["latency"] == 0.2
    # a resumed tune: the recorded outcome comes back without a launch (the script is gone)
    (tmp_path / "ok.py").unlink()
    again = _run(tmp_path, "ok")
    assert again.resumed and again.value("throughput") == 5.0


def test_launcher_flags_are_rebuilt_without_autotuning() -> None:
    args = argparse.Namespace(
        hostfile=None, include="", exclude="", master_addr="", launcher_args="",
        num_nodes=-1, num_gpus=2, launcher="pdsh", module=False, no_python=False,
        no_local_rank=True, no_ssh=False, no_ssh_check=False, force_multi=False,
        autotuning="run",
    )  # fmt: skip
    flags = launcher_argv(args)
    assert flags == ["--num_gpus=2", "--launcher=pdsh", "--no_local_rank"]
    assert not any("autotuning" in f for f in flags) and sys.executable
