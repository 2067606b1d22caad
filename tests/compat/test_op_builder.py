"""``ops.op_builder``, ``ops.__compatible_ops__`` and ``git_version_info`` under DeepSpeed's names."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import shardspeed
from shardspeed import git_version_info
from shardspeed.ops import __compatible_ops__, op_builder
from shardspeed.ops.adam import DeepSpeedCPUAdam
from shardspeed.ops.op_builder import ALL_OPS, CPUAdamBuilder, OpNotImplementedError

PURE_PYTHON = {
    "cpu_adam",
    "fused_adam",
    "cpu_adagrad",
    "fused_lamb",
    "cpu_lion",
    "fused_lion",
    "async_io",
}


def test_implemented_ops_load_their_module() -> None:
    builder = CPUAdamBuilder()
    assert builder.NAME == "cpu_adam" and builder.is_compatible()
    module = builder.load()
    assert module.DeepSpeedCPUAdam is DeepSpeedCPUAdam
    assert builder.absolute_name() == module.__name__
    for name in PURE_PYTHON:
        assert ALL_OPS[name].is_compatible() and ALL_OPS[name].load() is not None


def test_missing_ops_say_so() -> None:
    builder = op_builder.SparseAttnBuilder()
    assert not builder.is_compatible()
    with pytest.raises(OpNotImplementedError, match="sparse_attn"):
        builder.load()


def test_compatible_ops_and_version_info_agree() -> None:
    assert {n for n, ok in __compatible_ops__.items() if ok} == PURE_PYTHON
    assert git_version_info.compatible_ops == __compatible_ops__
    assert git_version_info.installed_ops == __compatible_ops__
    assert git_version_info.version == shardspeed.__version__
    assert git_version_info.git_hash == shardspeed.__git_hash__
    assert git_version_info.git_branch == shardspeed.__git_branch__
    info = git_version_info.torch_info
    assert set(info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    assert info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert isinstance(info["bf16_support"], bool)
    expected_cuda = ".".join(torch.version.cuda.split(".")[:2]) if torch.version.cuda else "0.0"
    assert info["cuda_version"] == expected_cuda


def test_version_info_imports_first_without_cycle() -> None:
    code = "import shardspeed.git_version_info as g; print(g.compatible_ops['cpu_adam'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
