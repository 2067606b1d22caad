"""``OpBuilder``: DeepSpeed's handle on one native op, for a package that builds none.

In DeepSpeed a builder compiles (or finds prebuilt) a C++/CUDA extension. shardspeed implements
ops in Python on PyTorch, so a builder is compatible exactly when shardspeed has the op, and
``load()`` returns the shardspeed module that implements it (import only, nothing is built).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class OpNotImplementedError(RuntimeError):
    """The op exists in DeepSpeed as a native extension and shardspeed has no version of it."""


class OpBuilder:
    """One op: its DeepSpeed ``NAME`` and the shardspeed module implementing it, if any."""

    NAME: str = ""
    IMPLEMENTATION: str | None = None
    """Dotted path of the shardspeed module that implements the op; ``None`` if none does."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        """The module ``load()`` returns (DeepSpeed: the extension's import path)."""
        return self.IMPLEMENTATION or f"shardspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True when shardspeed implements the op (pure Python: it runs wherever torch does)."""
        return self.IMPLEMENTATION is not None

    def load(self, verbose: bool = True) -> ModuleType:
        """The implementing module; :class:`OpNotImplementedError` names the op if none."""
        if self.IMPLEMENTATION is None:
            raise OpNotImplementedError(
                f"op {self.name!r} is a DeepSpeed native extension that shardspeed does not "
                f"implement; the ops shardspeed has are listed by "
                f"shardspeed.ops.__compatible_ops__"
            )
        return importlib.import_module(self.IMPLEMENTATION)

    def jit_load(self, verbose: bool = True) -> ModuleType:
        """Same as :meth:`load`: there is nothing to compile."""
        return self.load(verbose)

    def builder(self) -> None:
        """DeepSpeed's setuptools extension; shardspeed builds none."""
        return None
