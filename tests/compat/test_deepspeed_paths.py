"""DeepSpeed's internal import paths that third-party code uses, and what each does."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy
import pytest
import torch

from shardspeed.checkpoint.utils import get_model_ckpt_name_for_rank
from shardspeed.launcher import runner
from shardspeed.launcher.hostfile import HostfileError
from shardspeed.runtime.utils import move_to_device, set_random_seed
from shardspeed.runtime.zero.utils import ZeRORuntimeException
from shardspeed.utils.numa import parse_range_list
from shardspeed.utils.torch import required_torch_version


def test_environment_name_follows_ds_env_file(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    assert runner.DEEPSPEED_ENVIRONMENT_NAME == os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    monkeypatch.setenv("DS_ENV_FILE", ".my_env")
    try:
        assert importlib.reload(runner).DEEPSPEED_ENVIRONMENT_NAME == ".my_env"
    finally:
        monkeypatch.delenv("DS_ENV_FILE")
        importlib.reload(runner)
    assert runner.DEEPSPEED_ENVIRONMENT_PATHS == [os.path.expanduser("~"), "."]


def test_runner_hostfile_and_filter() -> None:
    hosts = runner._parse_hostfile(["worker-0 slots=2", "# comment", "worker-1 slots=4"])
    assert hosts == {"worker-0": 2, "worker-1": 4}
    with pytest.raises(HostfileError):
        runner._parse_hostfile(["worker-0 slots=two"])
    pool = {host: list(range(n)) for host, n in hosts.items()}
    assert runner.parse_resource_filter(pool, include_str="worker-1:1,3") == {"worker-1": [1, 3]}
    assert runner.parse_resource_filter(pool, exclude_str="worker-1") == {"worker-0": [0, 1]}
    with pytest.raises(ValueError, match="mutually exclusive"):
        runner.parse_resource_filter(pool, include_str="worker-0", exclude_str="worker-1")


def test_zero_runtime_exception() -> None:
    assert issubclass(ZeRORuntimeException, Exception)
    with pytest.raises(ZeRORuntimeException, match="stage"):
        raise ZeRORuntimeException("not at this stage")


def test_model_ckpt_name_for_rank(tmp_path: Path) -> None:
    name = get_model_ckpt_name_for_rank(str(tmp_path), "00")
    assert name == os.path.join(str(tmp_path), "mp_rank_00_model_states.pt")
    from shardspeed.checkpoint.files import MODEL_STATES

    assert os.path.basename(name) == MODEL_STATES


def test_parse_range_list() -> None:
    assert parse_range_list("0,2-4,6") == [0, 2, 3, 4, 6]
    assert parse_range_list("7") == [7]
    for bad in ("3-1", "0,0", "2-4,3", "a", "1-2-3", ""):
        with pytest.raises(ValueError, match="Bad range"):
            parse_range_list(bad)


def test_required_torch_version() -> None:
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=1.0)
    assert required_torch_version(min_version=major_minor, max_version="99.0")
    assert not required_torch_version(min_version="99.0")
    assert not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError):
        required_torch_version()


def test_set_random_seed_repeats() -> None:
    set_random_seed(123)
    first = (random.random(), numpy.random.rand(), torch.rand(1).item())
    set_random_seed(123)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == first


def test_move_to_device_keeps_tensor_objects() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a, b = torch.ones(2, dtype=torch.float64), torch.zeros(1)
    moved = move_to_device(
        {"x": [a, (b, "text")]}, device, lambda t: torch.is_tensor(t) and t.dtype == torch.float64
    )
    assert moved["x"][0] is a and a.device.type == device.type and a.tolist() == [1.0, 1.0]
    assert moved["x"][1][0] is b and b.device.type == "cpu"
    assert moved["x"][1][1] == "text" and isinstance(moved["x"][1], tuple)


def test_multinode_runner_exports() -> None:
    from shardspeed.launcher.backends import LaunchPlan
    from shardspeed.launcher.multinode_runner import MultiNodeRunner, SlurmRunner

    runner = SlurmRunner()
    assert isinstance(runner, MultiNodeRunner) and runner.exports == {}
    runner.add_export(" NCCL_DEBUG ", " WARN ")
    runner.add_export("HF_HOME", "/data/hf")
    assert runner.exports == {"NCCL_DEBUG": "WARN", "HF_HOME": "/data/hf"}
    plan = LaunchPlan(
        resources={"a": [0], "b": [0]},
        user_script="train.py",
        master_addr="a",
        exports={"NCCL_DEBUG": "INFO", "PATH": "/bin"},
    )
    export_flag = next(a for a in runner.get_cmd(runner.with_exports(plan)) if "--export" in a)
    assert "NCCL_DEBUG=WARN" in export_flag and "HF_HOME=/data/hf" in export_flag
    assert "PATH=/bin" in export_flag and "NCCL_DEBUG=INFO" not in export_flag
    assert SlurmRunner().with_exports(plan) is plan


def test_precision_config_sections() -> None:
    from shardspeed.config.errors import DeepSpeedConfigError
    from shardspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    assert get_bfloat16_config({"bf16": {"enabled": True}}).enabled
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    assert not get_bfloat16_config({}).enabled
    assert get_float16_config({"fp16": {"enabled": True, "loss_scale": 0}}).enabled
    with pytest.raises(DeepSpeedConfigError, match="enabld"):
        get_bfloat16_config({"bf16": {"enabld": True}})
    with pytest.raises(DeepSpeedConfigError, match="legacy"):
        get_bfloat16_config({"bf16": {}, "bfloat16": {}})
    with pytest.raises(DeepSpeedConfigError, match="must be an object"):
        get_bfloat16_config({"bf16": True})
