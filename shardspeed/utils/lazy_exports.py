"""A package's names resolved on first use (PEP 562 ``__getattr__``), as DeepSpeed's packages
expose them, without importing every submodule when the package is imported."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names`` maps an attribute to the module that
    defines it; any other public name that is a submodule is imported on first use. The value
    is cached in the package, so the hook runs once per name."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")  # a submodule, on first use
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
