"""DeepSpeed hostfiles: one ``HOSTNAME slots=N`` per line, ``#`` comments and blank lines ignored.

The parsed pool is an insertion-ordered ``{host: slot_count}``; the order of the file is the order
of node ranks. Every malformed input raises :class:`HostfileError` naming the file, the line and
the fix, where DeepSpeed would sometimes ignore the rest of a line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from shardspeed.launcher.constants import DEFAULT_HOSTFILE

# letters, digits, '.', '-', '_': what DNS names and IPv4 addresses need, and nothing that means
# something to a shell or to the include/exclude syntax ('@', ':', ',')
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SLOTS_RE = re.compile(r"^slots=(\S*)$")

_EXAMPLE = "'worker-1 slots=4'"


class HostfileError(ValueError):
    """A hostfile that cannot be used: missing, malformed, duplicated or empty."""


def validate_hostname(host: str, where: str) -> None:
    """Raise :class:`HostfileError` unless ``host`` is a plain host name or IPv4 address."""
    if not _HOST_RE.match(host):
        raise HostfileError(
            f"{where}: host name {host!r} may contain only letters, digits, '.', '-' and '_' "
            "and must start with a letter or digit"
        )


def _parse_line(text: str, where: str) -> tuple[str, int]:
    tokens = text.split()
    if len(tokens) != 2 or not _SLOTS_RE.match(tokens[1]):
        raise HostfileError(
            f"{where}: {text!r} is not 'HOSTNAME slots=N'; write one host per line, e.g. {_EXAMPLE}"
        )
    host, slots_token = tokens
    validate_hostname(host, where)
    value = slots_token.removeprefix("slots=")
    if not value.isdigit() or int(value) < 1:
        raise HostfileError(
            f"{where}: slots must be a positive integer, got {slots_token!r}; e.g. {_EXAMPLE}"
        )
    return host, int(value)


def parse_hostfile_lines(lines: Iterable[str], source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text into ``{host: slots}`` in file order.

    ``source`` names the file in error messages. Raises :class:`HostfileError` for a malformed
    line, a host listed twice, or a file that lists no host.
    """
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"hostfile {source} line {lineno}"
        host, slots = _parse_line(text, where)
        if host in pool:
            raise HostfileError(
                f"{where}: host {host!r} is listed twice (first on line {first_line[host]}); "
                "list each host once with its total slot count"
            )
        pool[host] = slots
        first_line[host] = lineno
    if not pool:
        raise HostfileError(f"hostfile {source} lists no hosts; add lines like {_EXAMPLE}")
    return pool


def read_hostfile(path: str) -> dict[str, int]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile_lines`)."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except FileNotFoundError:
        raise HostfileError(
            f"hostfile {path} not found; pass an existing file with -H/--hostfile, or leave "
            "the flag out to run on this machine only"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"hostfile {path} cannot be read: {exc}") from None
    return parse_hostfile_lines(lines, source=path)


def fetch_hostfile(path: str | None) -> dict[str, int] | None:
    """The resource pool for ``-H/--hostfile``.

    ``path=None`` means the flag was not given: DeepSpeed's default ``/job/hostfile`` is used
    when it exists, and ``None`` (run on this machine only) is returned when it does not. An
    explicit path must exist.
    """
    if path is None:
        if not os.path.isfile(DEFAULT_HOSTFILE):
            return None
        path = DEFAULT_HOSTFILE
    return read_hostfile(path)
