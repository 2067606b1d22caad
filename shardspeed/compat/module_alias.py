"""Make ``alias.X.Y`` import as the very module object ``target.X.Y`` (a meta-path finder).

The alias's submodules are not copies: importing ``alias.X`` imports ``target.X`` and stores the
same object under both names in ``sys.modules``, so classes, ``isinstance`` checks and module
state agree across the two names. The alias's top-level package is supplied by its own
distribution; this finder only answers for names below it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType


class AliasLoader(importlib.abc.Loader):
    """Loads ``alias.X`` by importing ``target.X`` and handing back that module object."""

    def __init__(self, target_name: str) -> None:
        self.target_name = target_name
        self._target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target_name)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the shared module; the module keeps
        # its own, so ``importlib.reload`` and pickling still see the real name
        if self._target_spec is not None:
            module.__spec__ = self._target_spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Answers ``find_spec`` for every name below ``alias`` with the module below ``target``."""

    def __init__(self, alias: str, target: str) -> None:
        self.alias = alias
        self.target = target

    def target_name(self, fullname: str) -> str | None:
        """``target.X.Y`` for ``alias.X.Y``; ``None`` for names this finder does not own."""
        if not fullname.startswith(self.alias + "."):
            return None
        return self.target + fullname[len(self.alias) :]

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        target_name = self.target_name(fullname)
        if target_name is None:
            return None
        target_spec = importlib.util.find_spec(target_name)
        if target_spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: {self.alias!r} is an alias of {self.target!r} "
                f"and {target_name!r} does not exist",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(
            fullname,
            AliasLoader(target_name),
            origin=target_spec.origin,
            is_package=target_spec.submodule_search_locations is not None,
        )


def install_alias(alias: str, target: str) -> AliasFinder:
    """Put an :class:`AliasFinder` first on ``sys.meta_path`` (once per alias) and return it."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder) and finder.alias == alias:
            if finder.target != target:
                raise ImportError(
                    f"{alias!r} is already an alias of {finder.target!r}, not {target!r}"
                )
            return finder
    finder = AliasFinder(alias, target)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall_alias(alias: str) -> None:
    """Remove the alias's finder and every ``alias.*`` entry from ``sys.modules``."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if not (isinstance(f, AliasFinder) and f.alias == alias)
    ]
    for name in [n for n in sys.modules if n == alias or n.startswith(alias + ".")]:
        del sys.modules[name]
