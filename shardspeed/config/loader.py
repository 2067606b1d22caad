"""Reading a DeepSpeed config from a dict, a JSON/HJSON file, base64 text or argparse args, and
applying the dotted top-level keys some clients write (:func:`apply_dotted_keys`)."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import math
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson
from pydantic import BaseModel

from shardspeed.config.errors import (
    DeepSpeedConfigError,
    annotation_members,
    field_for_key,
    known_keys,
    section_model,
    unknown_key_message,
)
from shardspeed.utils.logging import log_dist, logger

__all__ = [
    "ConfigSource",
    "apply_dotted_keys",
    "config_source_from_args",
    "load_config_dict",
    "parse_config_text",
]

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]

_BASE64 = re.compile(r"^[A-Za-z0-9_\-+/]+={0,2}$")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed rejects duplicate keys too: with plain json the last one would silently win.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DeepSpeedConfigError(f"duplicate key '{key}' in the DeepSpeed config")
        out[key] = value
    return out


def parse_config_text(text: str, source: str = "<string>") -> dict[str, Any]:
    """Parse JSON or HJSON text (decided by trying JSON first) into a dict."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError:
        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
        except hjson.HjsonDecodeError as exc:
            raise DeepSpeedConfigError(
                f"cannot parse DeepSpeed config {source} as JSON or HJSON: line {exc.lineno}, "
                f"column {exc.colno}: {exc.msg}"
            ) from None
    except DeepSpeedConfigError as exc:
        raise DeepSpeedConfigError(f"{exc} ({source})") from None
    if not isinstance(data, Mapping):
        raise DeepSpeedConfigError(
            f"DeepSpeed config {source} must be a JSON object, got {type(data).__name__}"
        )
    return _plain(data)


def _plain(value: Any) -> Any:
    # hjson returns OrderedDicts; the rest of shardspeed expects plain dicts.
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _from_base64(text: str) -> dict[str, Any] | None:
    """A config passed as base64 (the launcher does this); None when ``text`` is not one."""
    if not _BASE64.match(text):
        return None
    try:
        decoded = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("utf-8")
        return parse_config_text(decoded, "<base64>")
    except (binascii.Error, UnicodeDecodeError, DeepSpeedConfigError):
        return None


def load_config_dict(config: ConfigSource) -> dict[str, Any]:
    """A fresh dict from a config dict (deep-copied), a JSON/HJSON file path or base64 text."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise DeepSpeedConfigError(
            f"a DeepSpeed config must be a dict or a path to a JSON/HJSON file, got "
            f"{type(config).__name__}"
        )
    path = Path(config)
    if not path.is_file():
        decoded = _from_base64(config) if isinstance(config, str) else None
        if decoded is not None:
            return decoded
        what = "is a directory" if path.is_dir() else "does not exist"
        raise DeepSpeedConfigError(f"DeepSpeed config file '{path}' {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DeepSpeedConfigError(f"cannot read DeepSpeed config file '{path}': {exc}") from None
    return parse_config_text(text, f"file '{path}'")


def config_source_from_args(args: Any, config: ConfigSource | None = None) -> ConfigSource | None:
    """The config named by ``args.deepspeed_config`` (or legacy ``deepscale_config``) or ``config``.

    Giving a config both ways is an error, as in DeepSpeed.
    """
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    legacy = getattr(args, "deepscale_config", None) if args is not None else None
    if legacy is not None:
        if from_args is not None:
            raise DeepSpeedConfigError(
                "both --deepspeed_config and the deprecated --deepscale_config are given; "
                "keep only --deepspeed_config."
            )
        logger.warning("--deepscale_config is deprecated; use --deepspeed_config instead.")
        from_args = legacy
    if from_args is not None and config is not None:
        raise DeepSpeedConfigError(
            "a DeepSpeed config is given both in args.deepspeed_config and as the config "
            "argument; give only one."
        )
    return from_args if from_args is not None else config


def apply_dotted_keys(raw: dict[str, Any], root: type[BaseModel]) -> dict[str, Any]:
    """``raw`` (changed in place and returned) with each top-level key that is a dotted path
    into a section moved there, overriding the section's value: TRL writes
    ``{"zero_optimization.reduce_bucket_size": 1024}`` meaning ``zero_optimization``'s
    ``reduce_bucket_size`` (DeepSpeed ignores such keys). One log line names what was applied.
    A path that names no real key is an error naming the closest valid key; a first part that
    names no section of ``root`` is left for validation to report as an unknown key."""
    dotted = [k for k in raw if "." in k and field_for_key(root, k.split(".")[0]) is not None]
    applied = []
    for key in dotted:
        applied.append(_place(raw, root, key, raw.pop(key)))
    if applied:
        log_dist(
            "DeepSpeed config: dotted top-level keys applied as the nested keys they name "
            f"(DeepSpeed ignores them): {', '.join(applied)}",
            ranks=[0],
        )
    return raw


def _place(raw: dict[str, Any], root: type[BaseModel], key: str, value: Any) -> str:
    """Set the nested key dotted ``key`` names to ``value``; what was set, for the log."""
    *sections, leaf = key.split(".")
    container: dict[str, Any] = raw
    model: type[BaseModel] | None = root  # None: inside a free-form dict (optimizer.params)
    for depth, part in enumerate(sections):
        where = ".".join(sections[: depth + 1])
        annotation, same = _resolve(container, model, where, part)
        section = section_model(annotation) if model is not None else None
        if model is not None and section is None and not _is_mapping(annotation):
            raise DeepSpeedConfigError(
                f"top-level key '{key}': '{where}' is a value, not a section with keys; "
                f"set \"{where}\" itself or remove '{key}'"
            )
        target = same[0] if same else part
        child = container.get(target)
        if child is None:
            child = container[target] = {}
        if not isinstance(child, dict):
            raise DeepSpeedConfigError(
                f"top-level key '{key}' sets a key inside '{where}', but '{where}' is "
                f"{child!r}, not a section; write it as a section ({{...}}) or remove '{key}'"
            )
        container, model = child, section
    annotation, same = _resolve(container, model, key, leaf)
    for alias in same:  # the override replaces the section's value under any of its names
        del container[alias]
    container[leaf], note = _as_field_type(value, annotation)
    return f"{key}={container[leaf]!r}{note}"


def _resolve(
    container: dict[str, Any], model: type[BaseModel] | None, where: str, part: str
) -> tuple[Any, list[str]]:
    """The type of the field of ``model`` that key ``part`` (at dotted path ``where``) names
    (``Any`` in a free-form dict, ``model`` None), and the keys of ``container`` that already
    give it (under any of its names)."""
    if model is None:
        return Any, [part] if part in container else []
    found = field_for_key(model, part)
    if found is None:
        raise DeepSpeedConfigError(unknown_key_message(where, part, known_keys(model)))
    name, field = found
    same = [k for k in container if (other := field_for_key(model, k)) and other[0] == name]
    return field.annotation, same


def _is_mapping(annotation: Any) -> bool:
    """Whether a field of type ``annotation`` may hold a free-form dict."""
    return any(
        m in (dict, Mapping) or typing.get_origin(m) in (dict, Mapping)
        for m in annotation_members(annotation)
    )


def _as_field_type(value: Any, annotation: Any) -> tuple[Any, str]:
    """``value`` for a field of type ``annotation``: a fractional float for an integer field
    (an element count given as ``0.9 * hidden * hidden``) rounds down; the note says so."""
    members = annotation_members(annotation)
    fractional = isinstance(value, float) and math.isfinite(value) and not value.is_integer()
    if fractional and int in members and float not in members:
        return int(value), f" (from {value!r})"
    return value, ""
