"""What environment reaches the ranks on other nodes: an allowlist, never the whole environment.

Exported are variables whose names start with one of :data:`EXPORT_PREFIXES` (communication
library tuning, Python paths, CUDA settings, shardspeed's own knobs), plus every ``KEY=VALUE`` of
the env files ``.deepspeed_env`` and ``.shardspeed_env`` found in the home directory and then in the
working directory (later files win). ``DS_ENV_FILE`` renames ``.deepspeed_env`` as in DeepSpeed.
Anything else (tokens, credentials, ``HOME``, ``PATH``) stays on the launching machine.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping

EXPORT_PREFIXES: tuple[str, ...] = (
    "NCCL_",
    "PYTHON",
    "CUDA_",
    "SHARDSPEED_",
    "UCX_",
    "MV2_",
    "MLFLOW_",
)
EXPORT_NAMES: frozenset[str] = frozenset({"DS_ACCELERATOR"})
# node-local by nature: the node launcher sets it from the slots chosen for that node
NEVER_EXPORT: frozenset[str] = frozenset({"CUDA_VISIBLE_DEVICES"})

DEEPSPEED_ENV_FILE = ".deepspeed_env"
SHARDSPEED_ENV_FILE = ".shardspeed_env"

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def env_file_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The env file names searched for, in increasing priority."""
    environ = os.environ if environ is None else environ
    return [environ.get("DS_ENV_FILE", DEEPSPEED_ENV_FILE), SHARDSPEED_ENV_FILE]


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` lines; ``#`` comments, blank lines and a leading ``export`` are allowed.

    One pair of matching quotes around a value is removed. Raises ``ValueError`` naming the
    file and line for anything else.
    """
    result: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY_RE.match(key):
            raise ValueError(
                f"env file {source} line {lineno}: {raw.strip()!r} is not KEY=VALUE with a "
                "shell variable name as KEY; fix or remove the line"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        result[key] = value
    return result


def env_file_paths(
    cwd: str | None = None, home: str | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Existing env files, lowest priority first: home before working directory."""
    cwd = os.getcwd() if cwd is None else cwd
    home = os.path.expanduser("~") if home is None else home
    paths: list[str] = []
    for directory in dict.fromkeys([home, cwd]):
        for name in env_file_names(environ):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and path not in paths:
                paths.append(path)
    return paths


def is_exported(name: str) -> bool:
    """Whether the environment variable ``name`` is on the allowlist."""
    if name in NEVER_EXPORT:
        return False
    return name in EXPORT_NAMES or name.startswith(EXPORT_PREFIXES)


def collect_exports(
    environ: Mapping[str, str] | None = None, cwd: str | None = None, home: str | None = None
) -> dict[str, str]:
    """The variables to set on every remote node: allowlisted ones, then the env files' pairs."""
    environ = os.environ if environ is None else environ
    exports = {k: v for k, v in sorted(environ.items()) if is_exported(k)}
    for path in env_file_paths(cwd, home, environ):
        with open(path, encoding="utf-8") as handle:
            exports.update(parse_env_file(handle.read(), path))
    return exports


def shell_exports(exports: Mapping[str, str]) -> str:
    """``export K=V; ...`` with every value quoted for a POSIX shell."""
    return "".join(f"export {key}={shlex.quote(value)}; " for key, value in exports.items())
