"""ZeRO-3's per-step work, counted so a regression fails: at one rank no collective is issued
and each parameter carries one gradient hook; at every world size the running count of gathered
elements the hooks consult agrees with the buffers at every module call."""

from __future__ import annotations

import pytest

from tests.runtime.zero import overhead_ranks


@pytest.mark.timeout(180)
def test_one_rank_issues_no_collectives_and_one_hook_per_parameter(dist_pool):
    (result,) = dist_pool(1).run(overhead_ranks.step_overhead)
    # a reduce-scatter or all-gather over one rank hands back its input: none is issued
    assert not any("scatter" in op or "gather" in op for op in result["ops"]), result["ops"]
    # nothing can be released, so the release-on-last-gradient hook is not installed either
    assert result["moves"] is False
    assert result["grad_hooks"] and all(n == 1 for n in result["grad_hooks"]), result
    assert result["mismatches"] == [] and result["live_after"][0] == result["live_after"][1]
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.timeout(180)
def test_live_count_follows_the_buffers_on_two_ranks(dist_pool):
    results = dist_pool(2).run(overhead_ranks.step_overhead)
    for result in results:
        assert result["moves"] is True
        # the gradients are still reduce-scattered per unit and the parameters gathered
        assert result["ops"].get("reduce_scatter_tensor", 0) > 0, result["ops"]
        assert result["ops"].get("all_gather_into_tensor", 0) > 0, result["ops"]
        assert result["mismatches"] == [], result["mismatches"][:5]
        assert result["live_after"][0] == result["live_after"][1]
    assert results[0]["losses"] == results[1]["losses"]
