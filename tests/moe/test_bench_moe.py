"""The MoE benchmark at a tiny size: its all-to-all byte count equals the theory, ``ep_size`` 2
trains exactly as ``ep_size`` 1, and the index dispatch equals the dense einsum one."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import bench_moe

TINY = argparse.Namespace(
    stage=1,
    n_layer=4,
    n_embd=16,
    n_head=2,
    vocab=64,
    seq=8,
    micro=2,
    experts=4,
    k=1,
    capacity_factor=1.0,
    warmup=1,
    steps=2,
    dispatch_hidden=16,
    dispatch_repeats=1,
)


def test_all_to_all_bytes_and_losses(dist_pool):
    pool = dist_pool(2)
    one = pool.run(bench_moe.train_steps, 1, TINY)
    two = pool.run(bench_moe.train_steps, 2, TINY)
    theory = bench_moe.a2a_theory_bytes(TINY, 2)
    assert theory == 2 * 16 * 16 * 0.5 * 4 * 2  # 2 MoE layers, 16 tokens per rank
    for rank in range(2):
        assert one[rank]["a2a"] == {"fwd": [0, 0.0], "bwd": [0, 0.0]}
        for phase in ("fwd", "bwd"):
            msg, bus = two[rank]["a2a"][phase]
            assert (msg, bus) == (2 * theory, theory), phase
        assert two[rank]["expert_params"] * 2 == one[rank]["expert_params"]
        # the same training up to fp32 summation order (expert gradients summed in another order)
        assert two[rank]["losses"] == pytest.approx(one[rank]["losses"], rel=1e-5)


def test_index_dispatch_equals_dense():
    case = bench_moe._dispatch_case(64, 4, TINY)
    assert case["capacity"] == 16
    assert case["max_rel_diff"] < 1e-5
    assert case["dense"]["peak_mb"] > case["index"]["peak_mb"]
