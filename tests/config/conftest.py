"""Fixtures for the config tests: capture the ``shardspeed`` logger (it does not propagate)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.WARNING]


@pytest.fixture
def ds_log() -> Iterator[_Records]:
    """Records of everything the ``shardspeed`` logger emits during the test."""
    handler = _Records()
    log = logging.getLogger("shardspeed")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
