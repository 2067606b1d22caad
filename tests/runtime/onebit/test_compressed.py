"""The error-compensated 1-bit all-reduce: exact against a hand computation, and its bytes."""

from __future__ import annotations

import pytest

from tests.runtime.onebit.ranks import compressed_allreduce_case, compressed_allreduce_many_case


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_exact_and_bytes(dist_pool, world):
    numel = 4000  # not a multiple of 8 * world: the padding is exercised
    results = dist_pool(world).run(compressed_allreduce_case, numel, 3)
    for out in results:
        # three calls: the error feedback of the earlier ones enters the later ones
        assert out["equal"] == [True] * 3
        assert out["worker_ok"] == [True] * 3
        assert out["server_ok"] == [True] * 3
        assert out["result"].unique().numel() <= 2 * world  # one +/- scale per chunk
    for out in results[1:]:
        assert (out["result"] == results[0]["result"]).all()  # every rank ends equal
    volume = results[0]["volume"]
    n = -(-numel // (8 * world)) * (8 * world)
    ring = (world - 1) / world
    assert volume["all_to_all_single"]["bytes"] == 3 * n // 8
    # all_gather: the server's signs (n/8 bytes) and two scale vectors (4 bytes per rank)
    assert volume["all_gather"]["bytes"] == 3 * (n // 8 + 2 * 4 * world)
    sent = volume["all_to_all_single"]["bus_bytes"] + volume["all_gather"]["bus_bytes"]
    fp32_allreduce = 3 * 2 * ring * 4 * numel
    assert sent == pytest.approx(3 * ring * (n // 4 + 8 * world))
    assert fp32_allreduce / 34 < sent < fp32_allreduce / 30  # about 1/32, plus scales


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_many_matches_single_calls(dist_pool, world):
    # odd sizes: padding, a buffer smaller than one byte per rank, and a large one
    sizes = [1, 7, 4001, 33, 96, 517]
    for out in dist_pool(world).run(compressed_allreduce_many_case, sizes, 3):
        assert out["equal"] == [True] * 3  # bitwise, three calls of error feedback
        assert out["errors_equal"] == [True] * 3
        # one all_to_all and three all_gathers per call, whatever the number of buffers
        assert out["ops"] == [{"all_to_all_single": 1, "all_gather": 3}] * 3
        for batched, singles in out["bytes"]:
            assert batched == singles  # the same message bytes, in 4 messages not 4 per buffer
