"""What the opt-in ``deepspeed`` compatibility distribution does, and how to tell it is there.

The distribution (``compat/deepspeed``, installed with ``pip install ./compat/deepspeed``) holds a
``deepspeed/__init__.py`` that calls :func:`attach`. Its top-level module is a thin front: it has
its own ``__version__`` (DeepSpeed's API level plus a PEP 440 local label naming shardspeed, so
version checks such as ``deepspeed>=0.9.3`` pass while the version says what answered) and
forwards every other attribute to :mod:`shardspeed`. Every ``deepspeed.X.Y`` *is*
``shardspeed.X.Y`` (:mod:`.module_alias`).

:func:`which_deepspeed` tells ``shardspeed-report`` what ``import deepspeed`` gives without
importing it: the compatibility package, a real DeepSpeed, or nothing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import Any

from shardspeed.compat.module_alias import install_alias
from shardspeed.version import DEEPSPEED_API_VERSION, __version__

SHIM_MARKER = "__shardspeed_compat__"
"""Set to ``True`` in the compatibility package's ``deepspeed/__init__.py``."""

ALIAS = "deepspeed"
TARGET = "shardspeed"

logger = logging.getLogger("shardspeed.compat")


def compat_version() -> str:
    """``0.18.2+shardspeed.0.1.0``: DeepSpeed's API level, then the shardspeed release."""
    return f"{DEEPSPEED_API_VERSION}+shardspeed.{__version__}"


def _forwarder(namespace: dict[str, Any]) -> Callable[[str], Any]:
    import shardspeed

    def __getattr__(name: str) -> Any:
        try:
            return getattr(shardspeed, name)
        except AttributeError:
            pass
        # DeepSpeed's __init__ imports its subpackages (deepspeed.zero, deepspeed.monitor...);
        # shardspeed loads them on first use, so a missing attribute may be one to import
        if not name.startswith("_") and importlib.util.find_spec(f"{TARGET}.{name}") is not None:
            module = importlib.import_module(f"{ALIAS}.{name}")
            namespace[name] = module
            return module
        raise AttributeError(f"module {ALIAS!r} (shardspeed) has no attribute {name!r}")

    return __getattr__


def attach(namespace: dict[str, Any]) -> None:
    """Turn the module whose globals are ``namespace`` into shardspeed's ``deepspeed`` front."""
    import shardspeed

    install_alias(ALIAS, TARGET)
    version = compat_version()
    major, minor, patch = (int(p) for p in DEEPSPEED_API_VERSION.split("."))
    namespace.update(
        {
            SHIM_MARKER: True,
            "__version__": version,
            "__version_major__": major,
            "__version_minor__": minor,
            "__version_patch__": patch,
            "__git_hash__": shardspeed.__git_hash__,
            "__git_branch__": shardspeed.__git_branch__,
            "__all__": list(shardspeed.__all__),
            "__getattr__": _forwarder(namespace),
            "__dir__": lambda: sorted(set(namespace) | set(dir(shardspeed))),
        }
    )
    logger.debug(
        "import deepspeed: answered by the shardspeed compatibility package %s (%s, shardspeed "
        "at %s), not by DeepSpeed",
        version,
        namespace.get("__file__"),
        shardspeed.__file__,
    )


def _file_has_marker(path: str | None) -> bool:
    if not path:
        return False
    try:
        with open(path, encoding="utf-8") as handle:
            return SHIM_MARKER in handle.read()
    except OSError:
        return False


def _distribution_version() -> str | None:
    try:
        return importlib.metadata.version(ALIAS)
    except importlib.metadata.PackageNotFoundError:
        return None


def which_deepspeed() -> dict[str, Any]:
    """What ``import deepspeed`` gives here, found without importing it.

    ``answer`` is ``"shardspeed-compat"`` (this project's compatibility package),
    ``"deepspeed"`` (another package of that name, normally a real DeepSpeed) or ``"none"``.
    """
    module = sys.modules.get(ALIAS)
    if module is not None:
        origin = getattr(module, "__file__", None)
        is_shim = bool(getattr(module, SHIM_MARKER, False))
    else:
        spec = importlib.util.find_spec(ALIAS)
        if spec is None:
            return {
                "answer": "none",
                "origin": None,
                "version": None,
                "detail": "no package named deepspeed is installed",
            }
        origin = spec.origin
        is_shim = _file_has_marker(origin)
    version = _distribution_version()
    if is_shim:
        detail = "the shardspeed compatibility package: deepspeed.X is shardspeed.X"
        return {
            "answer": "shardspeed-compat",
            "origin": origin,
            "version": version,
            "detail": detail,
        }
    detail = "a package that is not shardspeed (normally a real DeepSpeed)"
    return {"answer": "deepspeed", "origin": origin, "version": version, "detail": detail}
