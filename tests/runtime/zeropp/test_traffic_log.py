"""The log line ZeRO++ writes at start-up states the bus bytes per step it saves; its figures
match what the byte counter measures in a step (4 ranks as 2 nodes of 2)."""

from __future__ import annotations

import re

import pytest

from tests.runtime.zeropp.ranks import traffic_case

ALL = {
    "zero_hpz_partition_size": 2,
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True,
}
_MB = 2**20
_LINE = re.compile(
    r"about ([\d.]+) MB .* plain ZeRO-3's ([\d.]+) MB; across nodes ([\d.]+) MB instead of "
    r"([\d.]+) MB \(([\d.]+)x less\)"
)


@pytest.mark.timeout(300)
def test_logged_savings_match_the_measured_step(dist_pool):
    pool = dist_pool(4)
    on, plain = pool.run(traffic_case, ALL)[0], pool.run(traffic_case, {})[0]
    assert plain["lines"] == []  # no ZeRO++, no line
    assert len(on["lines"]) == 1
    line = on["lines"][0]
    assert "hpZ over 2 ranks" in line and "qwZ int8" in line and "qgZ int4" in line
    found = _LINE.search(line)
    assert found, line
    total, total_plain, cross, cross_plain, _ = (float(x) for x in found.groups())
    # the agreement checks and the step's small collectives are not in the theory: within 10%
    assert total * _MB == pytest.approx(on["total"], rel=0.1)
    assert total_plain * _MB == pytest.approx(plain["total"], rel=0.1)
    assert cross * _MB == pytest.approx(on["crossing"], rel=0.1)
    assert cross_plain * _MB == pytest.approx(plain["crossing"], rel=0.1)
    assert on["crossing"] < 0.35 * plain["crossing"]
