"""DeepSpeed's ``deepspeed.runtime`` package: the engine and its parts.

``import deepspeed`` makes ``deepspeed.runtime.engine`` (and the other runtime submodules)
reachable as attributes; here each submodule is imported on its first attribute access (PEP
562), so ``import shardspeed`` stays fast and the attribute path still works. DeepSpeed's
``deepspeed.runtime.DeepSpeedOptimizer`` is the optimizer-wrapper base class.
"""

from __future__ import annotations

from shardspeed.utils.lazy_exports import lazy_exports

#: names DeepSpeed defines in the package itself -> the module that holds them here
_NAMES = {"DeepSpeedOptimizer": "shardspeed.runtime.base_optimizer"}


__getattr__ = lazy_exports(__name__, _NAMES)
