"""Fixtures for the precision tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from shardspeed.utils.logging import logger


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int | None = None) -> list[str]:
        return [r.getMessage() for r in self.records if level is None or r.levelno == level]


@pytest.fixture
def log_records(monkeypatch: pytest.MonkeyPatch) -> Iterator[_ListHandler]:
    """Collects what the shardspeed logger emits (it does not propagate, so caplog misses it)."""
    monkeypatch.setenv("RANK", "0")
    handler = _ListHandler()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)
