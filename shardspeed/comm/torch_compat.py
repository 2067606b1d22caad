"""torch.distributed functions whose names changed across the supported torch versions.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` and
deprecated the old names; older torch only has the old ones. shardspeed keeps DeepSpeed's public
names and calls whichever torch offers, so users see no deprecation warnings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
