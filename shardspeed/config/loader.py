"""Reading a DeepSpeed config from a dict, a JSON/HJSON file, base64 text or argparse args."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson

from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.utils.logging import logger

__all__ = ["ConfigSource", "config_source_from_args", "load_config_dict", "parse_config_text"]

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
