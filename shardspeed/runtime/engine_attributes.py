"""Attribute access on the engine falls through to the wrapped model, as DeepSpeed's does.

``engine.moe_1`` gives ``engine.module.moe_1`` and ``engine.config_class`` the model's own
attribute, so code written against the bare model keeps working on the engine. The engine's own
attributes come first (its methods, properties and submodules); a name neither has is an
``AttributeError`` naming both.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class ModuleAttributes(nn.Module):
    """Mixin for an ``nn.Module`` wrapper whose wrapped model is its submodule ``module``."""

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup failed: parameters, buffers and submodules next
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if hasattr(type(self), name):
            # an engine property whose getter raised: let its own error through
            return object.__getattribute__(self, name)
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        wrapped = "no wrapped model yet" if module is None else type(module).__name__
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '{name}', and neither has its "
            f"wrapped model (engine.module: {wrapped})"
        )
