"""DeepSpeed's ``deepspeed.utils.torch``: questions about the installed torch."""

from __future__ import annotations

import torch
from packaging.version import Version

__all__ = ["required_torch_version"]


def required_torch_version(
    min_version: str | float | None = None, max_version: str | float | None = None
) -> bool:
    """Whether the installed torch lies within ``[min_version, max_version]`` (either may be
    left out, not both); local labels such as ``+cu121`` are ignored."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version, max_version or both")
    installed = Version(Version(torch.__version__).base_version)
    if min_version is not None and installed < Version(str(min_version)):
        return False
    return max_version is None or installed <= Version(str(max_version))
