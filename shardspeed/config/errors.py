"""The config error type and the translation of pydantic errors into messages a user can act on.

Every problem a user can cause in a DeepSpeed config surfaces as :class:`DeepSpeedConfigError`,
whose message names the dotted path of the key (``zero_optimization.stage``), the value that was
given, and what is allowed. A misspelt key gets the closest valid key as a suggestion.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError

PathPart = str | int

__all__ = [
    "DeepSpeedConfigError",
    "annotation_members",
    "closest_key",
    "error_from_validation",
    "field_for_key",
    "format_path",
    "known_keys",
    "known_keys_of_field",
    "section_model",
    "split_path",
    "unknown_key_message",
]


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot be used; the message names the key, the value and the fix."""


def format_path(parts: Iterable[PathPart]) -> str:
    """Render ``("zero_optimization", "offload_param", "device")`` as a dotted path."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out:
            out += f".{part}"
        else:
            out = str(part)
    return out


def split_path(path: str | None) -> tuple[str, ...]:
    """Inverse of :func:`format_path` for plain dotted paths (no list indices)."""
    return tuple(p for p in (path or "").split(".") if p)


def known_keys(model_cls: type[BaseModel]) -> list[str]:
    """Every JSON key ``model_cls`` accepts: field names and all their aliases."""
    keys: list[str] = []
    for name, field in model_cls.model_fields.items():
        keys.append(name)
        keys.extend(sorted(known_keys_of_field(name, field) - {name}))
    return list(dict.fromkeys(keys))


def closest_key(key: str, candidates: Sequence[str]) -> str | None:
    """The valid key the user most likely meant (case-insensitive hit first, then difflib)."""
    by_lower = {c.lower(): c for c in candidates}
    if key.lower() in by_lower:
        return by_lower[key.lower()]
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(full_path: str, key: str, candidates: Sequence[str]) -> str:
    """Message for a key no model declares, with a suggestion or the list of valid keys."""
    suggestion = closest_key(key, candidates)
    if suggestion is not None:
        return f"Unknown key '{full_path}'; did you mean '{suggestion}'?"
    if candidates:
        return f"Unknown key '{full_path}'; valid keys here are: {', '.join(sorted(candidates))}."
    return f"Unknown key '{full_path}'."


def error_from_validation(
    exc: ValidationError, root: type[BaseModel], prefix: Sequence[PathPart] = ()
) -> DeepSpeedConfigError:
    """Turn a pydantic ``ValidationError`` raised while validating ``root`` into one config error.

    ``prefix`` is the path of ``root`` inside the whole DeepSpeed config (e.g. ``zero_optimization``
    when a ``DeepSpeedZeroConfig`` is built on its own), so messages always show full paths.
    """
    problems = list(dict.fromkeys(_describe(err, root, tuple(prefix)) for err in exc.errors()))
    if len(problems) == 1:
        return DeepSpeedConfigError(problems[0])
    listing = "\n  - ".join(problems)
    return DeepSpeedConfigError(f"{len(problems)} problems in the DeepSpeed config:\n  - {listing}")


def _describe(err: Mapping[str, Any], root: type[BaseModel], prefix: tuple[PathPart, ...]) -> str:
    loc = tuple(err["loc"])
    full = format_path(prefix + loc)
    if err["type"] == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        candidates = known_keys(parent) if parent is not None else []
        return unknown_key_message(full, str(loc[-1]), candidates)
    if err["type"] in ("value_error", "assertion_error"):
        cause = err.get("ctx", {}).get("error")
        text = str(cause) if cause is not None else str(err["msg"])
        return f"{full}: {text}" if full else text
    allowed = str(err["msg"]).replace("Input should be", "expected")
    return f"Invalid value {_short(err.get('input'))} for '{full}': {allowed}."


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def annotation_members(annotation: Any) -> list[Any]:
    """Flatten ``Annotated``/``Optional``/``Union`` into the member types."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return annotation_members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in annotation_members(arg)]
    return [annotation]


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class a field of type ``annotation`` holds (``FP16Config | None`` ->
    ``FP16Config``), or None for a plain value or a free-form dict."""
    for member in annotation_members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def field_for_key(model_cls: type[BaseModel], key: str) -> tuple[str, Any] | None:
    """The ``(field name, FieldInfo)`` that JSON key ``key`` fills in ``model_cls``, if any."""
    fields = model_cls.model_fields
    if key in fields:
        return key, fields[key]
    for name, field in fields.items():
        if key in known_keys_of_field(name, field):
            return name, field
    return None


def known_keys_of_field(name: str, field: Any) -> set[str]:
    """The field name plus every alias it can be given under."""
    keys = {name}
    if isinstance(field.alias, str):
        keys.add(field.alias)
    alias = field.validation_alias
    if isinstance(alias, str):
        keys.add(alias)
    elif isinstance(alias, AliasChoices):
        keys.update(c for c in alias.choices if isinstance(c, str))
    return keys


def _step(annotation: Any, part: PathPart) -> Any:
    for member in annotation_members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel) and isinstance(part, str):
            found = field_for_key(member, part)
            if found is not None:
                return found[1].annotation
        origin = typing.get_origin(member)
        args = typing.get_args(member)
        if origin in (list, tuple, set, Sequence) and isinstance(part, int) and args:
            return args[0]
        if origin in (dict, Mapping) and len(args) == 2:
            return args[1]
    return None


def _model_at(root: type[BaseModel], loc: Sequence[PathPart]) -> type[BaseModel] | None:
    """The model class that validates the mapping found at ``loc`` below ``root``."""
    current: Any = root
    for part in loc:
        current = _step(current, part)
        if current is None:
            return None
    return section_model(current)
