"""Every registered ZeRO strategy through the same interface, and a strategy made of two shard
groups on different process groups (the shape Mixture of Experts needs)."""

from __future__ import annotations

import pytest

from shardspeed.runtime.zero.registry import STRATEGIES
from tests.runtime.zero import strategy_ranks


def test_every_strategy_keeps_the_contract(dist_pool):
    stages = dist_pool(2).run(strategy_ranks.every_strategy_through_one_interface)
    assert stages[0] == sorted(STRATEGIES)


@pytest.mark.parametrize("stage", sorted(STRATEGIES), ids=lambda s: f"stage{s}")
def test_two_shard_groups_reduce_on_their_own_groups(dist_pool, stage):
    dist_pool(4).run(strategy_ranks.two_groups_reduce_on_their_own_process_groups, stage)
