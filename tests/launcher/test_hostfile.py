"""Hostfile parsing: DeepSpeed's documented format and every malformed input's exact error."""

from __future__ import annotations

import pytest

from shardspeed.launcher import hostfile as hf
from shardspeed.launcher.hostfile import HostfileError, fetch_hostfile, parse_hostfile_lines


def parse(text: str) -> dict[str, int]:
    return parse_hostfile_lines(text.splitlines(), source="hf")


def test_documented_example() -> None:
    text = "worker-1 slots=4\nworker-2 slots=4\n"
    assert parse(text) == {"worker-1": 4, "worker-2": 4}


def test_comments_blank_lines_whitespace_and_order() -> None:
    text = "# cluster A\n\n  zeta slots=2   # rack 1\n\talpha\tslots=8\n10.0.0.3 slots=1\n"
    pool = parse(text)
    assert pool == {"zeta": 2, "alpha": 8, "10.0.0.3": 1}
    assert list(pool) == ["zeta", "alpha", "10.0.0.3"]  # file order is node-rank order


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "worker-1\n",
            "hostfile hf line 1: 'worker-1' is not 'HOSTNAME slots=N'; write one host per "
            "line, e.g. 'worker-1 slots=4'",
        ),
        (
            "worker-1 slots=4\nworker-2 slot=4\n",
            "hostfile hf line 2: 'worker-2 slot=4' is not 'HOSTNAME slots=N'; write one host "
            "per line, e.g. 'worker-1 slots=4'",
        ),
        (
            "worker-1 slots=4 max_slots=8\n",
            "hostfile hf line 1: 'worker-1 slots=4 max_slots=8' is not 'HOSTNAME slots=N'; "
            "write one host per line, e.g. 'worker-1 slots=4'",
        ),
        (
            "worker-1 slots=four\n",
            "hostfile hf line 1: slots must be a positive integer, got 'slots=four'; e.g. "
            "'worker-1 slots=4'",
        ),
        (
            "worker-1 slots=0\n",
            "hostfile hf line 1: slots must be a positive integer, got 'slots=0'; e.g. "
            "'worker-1 slots=4'",
        ),
        (
            "worker-1 slots=-2\n",
            "hostfile hf line 1: slots must be a positive integer, got 'slots=-2'; e.g. "
            "'worker-1 slots=4'",
        ),
        (
            "worker-1 slots=4\n# c\nworker-1 slots=2\n",
            "hostfile hf line 3: host 'worker-1' is listed twice (first on line 1); list each "
            "host once with its total slot count",
        ),
        (
            "worker;rm slots=1\n",
            "hostfile hf line 1: host name 'worker;rm' may contain only letters, digits, '.', "
            "'-' and '_' and must start with a letter or digit",
        ),
        (
            "worker@1 slots=1\n",
            "hostfile hf line 1: host name 'worker@1' may contain only letters, digits, '.', "
            "'-' and '_' and must start with a letter or digit",
        ),
        ("", "hostfile hf lists no hosts; add lines like 'worker-1 slots=4'"),
        ("# only a comment\n\n", "hostfile hf lists no hosts; add lines like 'worker-1 slots=4'"),
    ],
)
def test_malformed(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as info:
        parse(text)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_read_missing_explicit_file(tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(HostfileError) as info:
        fetch_hostfile(str(missing))
    assert str(info.value) == (
        f"hostfile {missing} not found; pass an existing file with -H/--hostfile, or leave the "
        "flag out to run on this machine only"
    )


def test_default_hostfile_absent_means_local(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(hf, "DEFAULT_HOSTFILE", str(tmp_path / "job_hostfile"))
    assert fetch_hostfile(None) is None
    (tmp_path / "job_hostfile").write_text("a slots=2\n")
    assert fetch_hostfile(None) == {"a": 2}


def test_read_file_names_path_in_errors(hostfile) -> None:
    path = hostfile("good slots=1\nbad line here\n")
    with pytest.raises(HostfileError, match=f"hostfile {path} line 2: 'bad line here'"):
        fetch_hostfile(path)
