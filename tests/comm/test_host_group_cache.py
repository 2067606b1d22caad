"""``host_group`` makes one gloo group per device group and keys it by the device group itself:
an entry holds its device group (so that group's id is never reused while the entry lives), and
an entry whose group is not the one asked about is made again, never handed out."""

from __future__ import annotations

from typing import Any

import pytest

from shardspeed.comm import state


class _Group:
    """A stand-in for a NCCL process group (only its identity matters here)."""


def test_one_host_group_per_device_group(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[list[int]] = []

    def new_host_group(ranks: list[int]) -> Any:
        made.append(ranks)
        return ("gloo", len(made))

    monkeypatch.setattr(state, "_require_initialized", lambda what: None)
    monkeypatch.setattr(state.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(state, "get_all_ranks_from_group", lambda group: [0, 1])
    monkeypatch.setattr(state, "new_host_group", new_host_group)
    monkeypatch.setattr(state, "_HOST_GROUPS", {})
    first, second = _Group(), _Group()
    assert state.host_group(first) == ("gloo", 1)
    assert state.host_group(first) == ("gloo", 1)  # made once
    assert state.host_group(second) == ("gloo", 2)
    assert state._HOST_GROUPS[id(first)][0] is first  # held: its id cannot be reused
    # an entry left under this id by another group is not handed out
    third = _Group()
    state._HOST_GROUPS[id(third)] = (object(), ("gloo", "stale"))
    assert state.host_group(third) == ("gloo", 3)


def test_destroying_a_group_destroys_its_host_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device group destroyed alone takes its host twin with it (the cache no longer holds
    either); another group's entry stays, and a group never given a host group is destroyed
    alone."""
    destroyed: list[Any] = []
    monkeypatch.setattr(state, "_require_initialized", lambda what: None)
    monkeypatch.setattr(state.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(state, "get_all_ranks_from_group", lambda group: [0, 1])
    monkeypatch.setattr(state, "new_host_group", lambda ranks: ("gloo", object()))
    monkeypatch.setattr(state.dist, "destroy_process_group", destroyed.append)
    monkeypatch.setattr(state, "_HOST_GROUPS", {})
    first, second = _Group(), _Group()
    host_first, host_second = state.host_group(first), state.host_group(second)
    state.destroy_process_group(first)
    assert destroyed == [host_first, first]
    assert id(first) not in state._HOST_GROUPS and state.host_group(second) is host_second
    plain = _Group()  # never asked for a host group
    state.destroy_process_group(plain)
    assert destroyed[-1] is plain and len(destroyed) == 3
