"""The engine under sequence parallelism (``sequence_parallel_size``): ZeRO 0-3 shard and
average over the data- and sequence-parallel ranks together, so the shard losses combined as
DeepSpeed's ALST tutorial does give exactly the gradients of one process on whole sequences
(DeepSpeed 0.19.8's ZeRO-2 path gives them ``sp`` times too large: it sums over the sequence
ranks gradients that the differentiable all-gather already scaled)."""

from __future__ import annotations

import pytest

from tests.runtime.sequence_parallel import sp_engine_ranks

TOL = 1e-5


def _check(results: list[list[dict]], cases: list[dict]) -> None:
    for rank_results in results:
        for case, got in zip(cases, rank_results, strict=True):
            assert got["loss"] < TOL, f"{case}: loss off by {got['loss']:.2e}"
            assert got["param"] < TOL, f"{case}: parameters off by {got['param']:.2e}"


@pytest.mark.timeout(300)
def test_toy_attention_sp2_every_zero_stage(dist_pool) -> None:
    cases = [
        dict(sp=2, stage=0),
        dict(sp=2, stage=1, gas=2),
        dict(sp=2, stage=2),
        dict(sp=2, stage=3, via="mpu"),  # parallel_state_sp given as the mpu
        dict(sp=2, stage=2, extra={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
        dict(sp=2, stage=3, clip=0.05, masked=False),
        # TiledMLP and TiledFusedLogitsLoss (3 tiles of each 8-token shard) against the untiled
        # model in one process: each parameter's gradient arrives once, ZeRO-3 gathers once
        dict(sp=2, stage=3, tiled=True),
        dict(sp=2, stage=2, gas=2, tiled=True, via="mpu"),
    ]
    _check(dist_pool(2).run(sp_engine_ranks.toy_cases, cases, timeout_s=280), cases)


@pytest.mark.timeout(400)
def test_toy_attention_sp4_and_sp2_by_dp2(dist_pool) -> None:
    cases = [
        dict(sp=4, stage=2),
        dict(sp=4, stage=3, via="mpu"),
        dict(sp=2, stage=0),  # 2 sequence-parallel x 2 data-parallel ranks
        dict(sp=2, stage=1, gas=2, via="mpu"),
        dict(sp=2, stage=2),
        dict(sp=2, stage=3),
    ]
    _check(dist_pool(4).run(sp_engine_ranks.toy_cases, cases, timeout_s=380), cases)


@pytest.mark.timeout(400)
def test_hf_llama_and_qwen2_sp2(dist_pool) -> None:
    """Ulysses over 2 ranks (4 query, 2 key/value heads: one of each per rank)."""
    cases = [
        dict(kind="llama", sp=2, stage=2),
        dict(kind="qwen2", sp=2, stage=3),
        dict(kind="llama", sp=2, stage=3, gas=2),
        dict(
            kind="qwen2",
            sp=2,
            stage=2,
            extra={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        ),
    ]
    _check(dist_pool(2).run(sp_engine_ranks.hf_cases, cases, timeout_s=380), cases)


@pytest.mark.timeout(600)
def test_hf_sp4_sp2_by_dp2_and_the_ring_fallback(dist_pool) -> None:
    cases = [
        # sp 4 > 2 key/value heads: each kept by 2 ranks
        dict(kind="llama", sp=4, stage=2),
        dict(kind="qwen2", sp=4, stage=3),
        # 2 sequence-parallel x 2 data-parallel ranks
        dict(kind="qwen2", sp=2, stage=2),
        dict(kind="llama", sp=2, stage=3),
        # 6 query heads, 2 key/value heads at sp 4: Ulysses over 2 ranks x ring over 2
        dict(kind="llama", sp=4, stage=3, heads=6, kv_heads=2),
        # 3 query heads at sp 2: the ring alone
        dict(kind="qwen2", sp=2, stage=2, heads=3, kv_heads=1, steps=5),
    ]
    _check(dist_pool(4).run(sp_engine_ranks.hf_cases, cases, timeout_s=580), cases)
