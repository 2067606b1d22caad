"""DeepSpeed's launcher API as its own tests call it: ``parse_resource_filter`` keywords and
semantics, ``runner.main`` refusing limits combined with filters, and the runner constructors."""

from __future__ import annotations

import pytest

from shardspeed.launcher import multinode_runner as mnrunner
from shardspeed.launcher import runner as dsrun
from shardspeed.launcher.world_info import decode_world_info

HOSTS = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, HOSTS),
        ({"exclude_str": "worker-0:1"}, {"worker-0": [0, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"include_str": "worker-1:0,3"}, {"worker-1": [0, 3]}),
        ({"include_str": "worker-0:1,1"}, {"worker-0": [1]}),
        # a host named twice: its entries are merged, as DeepSpeed does
        ({"include_str": "worker-0:1@worker-0:0,1"}, {"worker-0": [0, 1]}),
        ({"include_str": "worker-0:1@worker-0"}, {"worker-0": [0, 1, 2, 3]}),
        ({"exclude_str": "worker-0:0@worker-0:1"}, {"worker-0": [2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"exclude_str": "worker-0:0,1@worker-1:3"}, {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
        # excluding everything leaves nothing, and is not an error here
        ({"exclude_str": "worker-0@worker-1"}, {}),
        ({"exclude_str": "worker-0:0,1,2,3@worker-1"}, {}),
    ],
)
def test_parse_resource_filter_with_deepspeed_keywords(kwargs, expected) -> None:
    assert dsrun.parse_resource_filter(HOSTS, **kwargs) == expected


def test_parse_resource_filter_errors() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        dsrun.parse_resource_filter({}, include_str="A", exclude_str="B")
    for kwargs in (
        {"include_str": "jeff"},
        {"exclude_str": "jeff"},
        {"include_str": "worker-1:4"},
        {"exclude_str": "worker-1:4"},
        {"exclude_str": "worker-1@worker-0:1@5"},
    ):
        with pytest.raises(ValueError):
            dsrun.parse_resource_filter(HOSTS, **kwargs)


@pytest.mark.parametrize(
    "argv",
    [
        "--num_nodes 1 -i localhost foo.py",
        "--num_nodes 1 --num_gpus 1 -i localhost foo.py",
        "--num_gpus 1 -i localhost foo.py",
        "--num_nodes 1 -e localhost foo.py",
        "--num_nodes 1 --num_gpus 1 -e localhost foo.py",
        "--num_gpus 1 -e localhost foo.py",
        "--num_gpus 0 --include localhost:0 foo.py",
    ],
)
def test_main_refuses_limits_with_filters(monkeypatch, argv: str) -> None:
    def launched(*args, **kwargs):
        pytest.fail(f"main() launched instead of refusing: {args}")

    monkeypatch.setattr(dsrun.node_launch, "main", launched)
    monkeypatch.setattr(dsrun.subprocess, "Popen", launched)
    with pytest.raises(ValueError, match="cannot be combined with --(include|exclude)"):
        dsrun.main(args=argv.split())


def test_cli_reports_the_same_error_as_exit_2(monkeypatch, caplog) -> None:
    monkeypatch.setattr(dsrun.node_launch, "main", lambda *a: pytest.fail("launched"))
    assert dsrun.cli(["--num_gpus", "2", "-e", "localhost:1", "foo.py"]) == 2
    assert "--num_gpus 2 cannot be combined with --exclude 'localhost:1'" in caplog.text


def test_runner_constructors_take_deepspeeds_arguments() -> None:
    args = dsrun.parse_args(["test_launcher.py", "--lr", "1"])
    pool = {"worker-0": 4, "worker-1": 4}
    world_info = dsrun.encode_world_info({"worker-0": [0, 1], "worker-1": [0, 1]})
    pdsh = mnrunner.PDSHRunner(args, world_info)
    assert pdsh.args is args
    assert decode_world_info(pdsh.world_info_base64) == {"worker-0": [0, 1], "worker-1": [0, 1]}
    assert pdsh.user_script == "test_launcher.py" and pdsh.user_arguments == ["--lr", "1"]
    for cls in (
        mnrunner.OpenMPIRunner,
        mnrunner.MPICHRunner,
        mnrunner.IMPIRunner,
        mnrunner.MVAPICHRunner,
        mnrunner.SlurmRunner,
    ):
        runner = cls(args, world_info, pool)
        assert runner.args is args and runner.world_info_base64 == world_info
        assert runner.resource_pool == pool
    # the launcher itself builds them bare
    assert mnrunner.PDSHRunner().args is None and mnrunner.SlurmRunner().resource_pool == {}
