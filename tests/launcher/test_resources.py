"""--include / --exclude / --num_nodes / --num_gpus selection, with DeepSpeed's documented examples."""

from __future__ import annotations

import pytest

from shardspeed.launcher import resources
from shardspeed.launcher.resources import (
    limit_resources,
    local_accelerator_count,
    parse_inclusion_exclusion,
    select_resources,
)

POOL = {"worker-0": 4, "worker-1": 4}
DOC_POOL = {"worker-1": 4, "worker-2": 4, "worker-3": 4}


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        # the two examples of the launcher's --help
        ("worker-0@worker-1:0,2", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        ("", "worker-1:0", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}),
        # no filter: everything
        ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        # a whole host excluded
        ("", "worker-0", {"worker-1": [0, 1, 2, 3]}),
        # slot order and duplicates in the filter do not matter; hostfile order wins
        ("worker-1:2,0,2@worker-0:3", "", {"worker-0": [3], "worker-1": [0, 2]}),
        # excluding every slot of a host drops the host
        ("", "worker-0:0,1,2,3", {"worker-1": [0, 1, 2, 3]}),
    ],
)
def test_filters(include: str, exclude: str, expected: dict[str, list[int]]) -> None:
    result = parse_inclusion_exclusion(POOL, include, exclude)
    assert result == expected
    assert list(result) == list(expected)


def test_documented_tutorial_examples() -> None:
    # "deepspeed --include="worker-2:0,1" ...": only two GPUs of worker-2
    assert parse_inclusion_exclusion(DOC_POOL, "worker-2:0,1") == {"worker-2": [0, 1]}
    # "deepspeed --exclude="worker-2:0@worker-3:0,1" ..."
    assert parse_inclusion_exclusion(DOC_POOL, "", "worker-2:0@worker-3:0,1") == {
        "worker-1": [0, 1, 2, 3],
        "worker-2": [1, 2, 3],
        "worker-3": [2, 3],
    }
    # "--num_nodes 2 --num_gpus 1"
    assert select_resources(DOC_POOL, num_nodes=2, num_gpus=1) == {
        "worker-1": [0],
        "worker-2": [0],
    }


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        (
            "worker-0",
            "worker-1",
            "--include and --exclude are mutually exclusive; keep one of them (list what to use "
            "with --include, or what to skip with --exclude)",
        ),
        (
            "worker-9",
            "",
            "--include: host 'worker-9' is not in the hostfile (known hosts: worker-0, worker-1); "
            "fix the name or add the host to the hostfile",
        ),
        (
            "",
            "worker-1:7",
            "--exclude: host 'worker-1' has no slot 7 (it has slots 0,1,2,3); pick slots from "
            "that list",
        ),
        (
            "worker-1:a",
            "",
            "--include 'worker-1:a': slot 'a' of host 'worker-1' is not a non-negative integer; "
            "use NAME[:SLOT[,SLOT...]] joined by '@', e.g. \"worker-0@worker-1:0,2\"",
        ),
        (
            "worker-1:",
            "",
            "--include 'worker-1:': slot '' of host 'worker-1' is not a non-negative integer; "
            "use NAME[:SLOT[,SLOT...]] joined by '@', e.g. \"worker-0@worker-1:0,2\"",
        ),
        (
            "worker-0@@worker-1",
            "",
            "--include 'worker-0@@worker-1' has an empty node entry; use NAME[:SLOT[,SLOT...]] "
            "joined by '@', e.g. \"worker-0@worker-1:0,2\"",
        ),
        (
            ":0",
            "",
            "--include ':0': ':0' has no host name; use NAME[:SLOT[,SLOT...]] joined by '@', "
            'e.g. "worker-0@worker-1:0,2"',
        ),
    ],
)
def test_filter_errors(include: str, exclude: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_inclusion_exclusion(POOL, include, exclude)
    assert str(info.value) == message


def test_limits() -> None:
    active = {"a": [0, 1, 2, 3], "b": [1, 3], "c": [0]}
    assert limit_resources(active) == active
    assert limit_resources(active, num_nodes=2) == {"a": [0, 1, 2, 3], "b": [1, 3]}
    # --num_gpus keeps the first N *selected* slots (an include's choice is respected)
    assert limit_resources(active, num_nodes=2, num_gpus=2) == {"a": [0, 1], "b": [1, 3]}


def test_limit_errors() -> None:
    with pytest.raises(ValueError) as info:
        limit_resources({"a": [0], "b": [0]}, num_nodes=3)
    assert str(info.value) == (
        "--num_nodes 3 but only 2 host(s) are available (a, b); lower --num_nodes or add hosts "
        "to the hostfile"
    )
    with pytest.raises(ValueError) as info:
        limit_resources({"a": [0, 1, 2, 3], "b": [1, 3]}, num_gpus=3)
    assert str(info.value) == (
        "--num_gpus 3 but host 'b' has only 2 selected slot(s) (1,3); lower --num_gpus or fix "
        "the hostfile"
    )


def test_select_applies_filter_then_limits() -> None:
    pool = {"a": 4, "b": 4, "c": 4}
    assert select_resources(pool, exclude="a", num_nodes=1, num_gpus=2) == {"b": [0, 1]}


def test_select_refuses_a_filter_that_leaves_nothing() -> None:
    # parse_inclusion_exclusion returns {} as DeepSpeed's does; a launch of nothing is an error
    assert parse_inclusion_exclusion(POOL, "", "worker-0@worker-1") == {}
    with pytest.raises(ValueError) as info:
        select_resources(POOL, exclude="worker-0@worker-1")
    assert str(info.value) == "--exclude leaves no host or slot to run on; relax the filter"


def test_local_accelerator_count(monkeypatch) -> None:
    monkeypatch.setattr(resources, "_installed_nvidia_gpus", lambda: 4)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_accelerator_count() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert local_accelerator_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_accelerator_count() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert local_accelerator_count() == 1
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert local_accelerator_count() is None
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(resources, "_installed_nvidia_gpus", lambda: 0)
    assert local_accelerator_count() is None
