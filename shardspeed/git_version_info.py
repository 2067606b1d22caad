"""DeepSpeed's ``deepspeed.git_version_info``: the release, git metadata, which ops exist, torch.

``installed_ops`` and ``compatible_ops`` agree: an op shardspeed implements is Python, so it is
"installed" (nothing to build) and runs wherever torch does. ``torch_info`` is computed on first
access so that importing this module never initialises CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.ops.op_builder.all_ops import op_compatibility
from shardspeed.version import __git_branch__ as git_branch
from shardspeed.version import __git_hash__ as git_hash
from shardspeed.version import __version__ as version

# torch_info is served by the module __getattr__ below (computed on first access)
__all__ = ["compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]  # noqa: F822

compatible_ops: dict[str, bool] = op_compatibility()
installed_ops: dict[str, bool] = dict(compatible_ops)

_NONE = "0.0"


def _major_minor(text: str | None) -> str:
    return ".".join(text.split(".")[:2]) if text else _NONE


def _nccl_version() -> str:
    if not torch.version.cuda:
        return _NONE
    try:
        raw = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return _NONE
    return ".".join(map(str, raw[:2])) if isinstance(raw, tuple) else _NONE


def collect_torch_info() -> dict[str, Any]:
    """``{"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}`` as
    ``"major.minor"`` strings (``"0.0"`` when absent), as DeepSpeed records them."""
    from shardspeed.accelerator import get_accelerator

    return {
        "version": _major_minor(torch.__version__),
        "bf16_support": bool(get_accelerator().is_bf16_supported()),
        "cuda_version": _major_minor(torch.version.cuda),
        "nccl_version": _nccl_version(),
        "hip_version": _major_minor(getattr(torch.version, "hip", None)),
    }


_torch_info: dict[str, Any] | None = None


def __getattr__(name: str) -> Any:
    global _torch_info
    if name == "torch_info":
        if _torch_info is None:
            _torch_info = collect_torch_info()
        return _torch_info
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
