"""Deprecated config keys: migrated to their replacement with exactly one warning.

A model lists its deprecated keys in ``deprecated_keys``; the base model applies them before
validation. Giving both a deprecated key and its replacement is ambiguous and is an error.
A migrated key is consumed (its own field stays ``None``), so re-validation on assignment does
not migrate it twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.utils.logging import logger

__all__ = ["DeprecatedKey", "apply_deprecations"]


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class DeprecatedKey:
    """One deprecated key of a section and how its value moves to the replacement.

    ``replaced_by`` lists the keys that count as "the replacement was given" (the new field name
    and its aliases); the first one receives the converted value. ``convert`` maps the old value
    to the new one, returning ``None`` to drop it (e.g. ``cpu_offload: false``). ``migrate``
    replaces the default "write into ``replaced_by[0]``" step when the move is not one key to one
    key; it must raise :class:`DeepSpeedConfigError` itself on a conflict.
    """

    old: str
    replaced_by: tuple[str, ...]
    hint: str = ""
    convert: Callable[[Any], Any] = _identity
    migrate: Callable[[dict[str, Any], Any], None] | None = field(default=None)

    @property
    def replacement(self) -> str:
        """How the replacement is named in messages."""
        return self.hint or self.replaced_by[0]

    def apply(self, data: dict[str, Any], section: str) -> None:
        """Move ``data[self.old]`` to its replacement in place, warning once."""
        value = data.pop(self.old, None)
        if value is None:
            return
        where = f"{section}." if section else ""
        if self.migrate is None:
            given = [key for key in self.replaced_by if data.get(key) is not None]
            if given:
                raise DeepSpeedConfigError(
                    f"both the deprecated key '{self.old}' and its replacement '{given[0]}' are "
                    f"given; remove '{self.old}' and keep '{given[0]}'."
                )
        logger.warning(
            f"Config key '{where}{self.old}' is deprecated; use '{where}{self.replacement}' instead."
        )
        if self.migrate is not None:
            self.migrate(data, value)
            return
        new_value = self.convert(value)
        if new_value is not None:
            data[self.replaced_by[0]] = new_value


def apply_deprecations(
    data: dict[str, Any], deprecated: tuple[DeprecatedKey, ...], section: str
) -> dict[str, Any]:
    """Apply every entry of ``deprecated`` to ``data`` (in order) and return it."""
    for entry in deprecated:
        entry.apply(data, section)
    return data
