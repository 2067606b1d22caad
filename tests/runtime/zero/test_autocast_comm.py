"""torch_autocast: lower-precision-safe modules' gradients are communicated in the autocast dtype
(DeepSpeed's ``torch_autocast.lower_precision_safe_modules``), the rest in fp32."""

from __future__ import annotations

import pytest

from tests.runtime.zero import autocast_ranks


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["stage0", "stage1", "stage2"])
def test_safe_modules_reduce_in_autocast_dtype(dist_pool, stage):
    dist_pool(2).run(autocast_ranks.reduces_safe_modules_in_autocast_dtype, stage)
