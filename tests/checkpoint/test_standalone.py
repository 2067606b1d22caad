"""The ``zero_to_fp32.py`` written beside every checkpoint: generated from the package's modules,
it needs only torch, and run on its own it writes exactly what the package consolidates.

Each case runs the script in a fresh interpreter (``-I``: no ``PYTHONPATH``, no user site, not
the current directory) in an empty directory, with any import of ``shardspeed`` or ``deepspeed``
made to fail, on checkpoints saved now (stages 0 and 2), saved by shardspeed at 7925258 and saved
by DeepSpeed; its output must equal ``get_fp32_state_dict_from_zero_checkpoint`` tensor for
tensor.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from shardspeed.checkpoint.standalone import SCRIPT_NAME, script_text, write_script
from tests.checkpoint.test_zero_to_fp32 import train_and_save

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

#: runs ``argv[1]`` as ``__main__`` with the rest as its arguments, where no module of shardspeed
#: or DeepSpeed can be imported (shardspeed is installed in this environment)
_ISOLATED = """
import runpy, sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("shardspeed", "deepspeed"):
            raise ModuleNotFoundError(f"{name} is not installed here", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_isolated(script: Path, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-I", "-c", _ISOLATED, str(script), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_script_imports_only_torch_and_the_standard_library(tmp_path):
    # the isolation holds: a script importing shardspeed fails under it
    (tmp_path / "imports.py").write_text("import shardspeed.checkpoint\n")
    refused = run_isolated(tmp_path / "imports.py", cwd=tmp_path)
    assert refused.returncode == 1 and "shardspeed is not installed" in refused.stderr
    text = script_text()
    tree = ast.parse(text)  # it compiles
    compile(text, SCRIPT_NAME, "exec")
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, node.lineno
            imported.add((node.module or "").split(".")[0])
    assert "import shardspeed" not in text and "from shardspeed" not in text
    # safetensors is imported inside convert_zero_checkpoint_to_fp32_state_dict, when asked for
    assert imported - set(sys.stdlib_module_names) == {"torch", "safetensors"}, imported
    future = tree.body[1]  # after the docstring, before any other statement
    assert ast.get_docstring(tree) is not None
    assert isinstance(future, ast.ImportFrom) and future.module == "__future__"
    assert text.rstrip().endswith('if __name__ == "__main__":\n    main()')


def _compare(script: Path, checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    run = run_isolated(script, checkpoint, out, cwd=cwd)
    assert run.returncode == 0, run.stderr
    written = torch.load(out / "pytorch_model.bin", weights_only=True)
    expected = get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert written[name].dtype == value.dtype and torch.equal(written[name], value), name


@pytest.mark.parametrize(
    "stage,dtype", [(0, "bf16"), (2, "bf16"), (2, "fp32")], ids=["stage0", "stage2", "stage2-fp32"]
)
@pytest.mark.timeout(240)
def test_script_saved_now_agrees_with_the_package(dist_pool, tmp_path, stage, dtype):
    ckpt = tmp_path / "ckpt"
    dist_pool(2).run(train_and_save, str(ckpt), stage, dtype, True)
    script = ckpt / SCRIPT_NAME
    assert script.read_text() == script_text()
    _compare(script, ckpt, tmp_path)


@pytest.mark.parametrize(
    "fixture",
    [
        "shardspeed_7925258/stage0_bf16",
        "shardspeed_7925258/stage2_fp32_groups",
        "deepspeed_zero2",
        "deepspeed_zero2_bf16",
    ],
)
def test_script_agrees_with_the_package_on_older_checkpoints(tmp_path, fixture):
    script = write_script(tmp_path)
    assert script == tmp_path / SCRIPT_NAME and not list(tmp_path.glob("*.tmp"))
    _compare(script, FIXTURES / fixture, tmp_path)
