"""Column- and row-parallel linears for training (`runtime/tensor_parallel/layers.py`): forward
and every gradient equal the whole layers on 2 ranks and, with uneven pieces, on 4."""

from __future__ import annotations

import pytest

from shardspeed.runtime.tensor_parallel.layers import split_widths
from shardspeed.runtime.zero.comm_group import CommGroup
from tests.runtime.tensor_parallel import ranks


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world", "widths"), [(2, (3, 3)), (4, (2, 2, 1, 1))])
def test_parallel_linears_equal_the_whole_layers(dist_pool, world, widths) -> None:
    results = dist_pool(world).run(ranks.layers_equal_the_whole_layers)
    for result in results:
        assert result["widths"] == widths
        assert result["marks"] == [True, True, True, False]  # a row bias counts once


def test_widths_follow_the_grain_and_refuse_too_few_features() -> None:
    four = CommGroup(group=None, rank=0, world_size=4)
    assert split_widths(16, four, grain=4) == (4, 4, 4, 4)
    assert split_widths(24, four, grain=4) == (8, 8, 4, 4)
    with pytest.raises(ValueError, match="3 features cannot be split over 4"):
        split_widths(3, four)
