"""ZeRO++ qgZ (quantized hierarchical gradient reduce-scatter) and LoCo's error feedback on 4
gloo ranks seen as 2 nodes of 2: results within the int4 error bound of the exact sums, bytes
equal to the theory and never a full-precision reduce-scatter, overflow kept visible, error
feedback cancelling the accumulated error and cleared every ``reset_T`` reductions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.runtime.comm.quantize import INT4, quantize
from shardspeed.runtime.comm.quantized_reduce import dequantize_rows, quantize_rows
from shardspeed.runtime.zero.zeropp import LocoSettings
from tests.harness.distributed import DistributedPool
from tests.runtime.zeropp import grad_ranks
from tests.runtime.zeropp.grad_ranks import CHUNK, source_of

WORLD, NODE = 4, 2
Pool = Callable[[int], DistributedPool]


def half_steps(row: torch.Tensor) -> torch.Tensor:
    """Per element of ``row``, half the int4 step of its block: its largest rounding error."""
    blocks = INT4.blocks(row.numel())
    padded = torch.zeros(blocks * INT4.block)
    padded[: row.numel()] = row.abs()
    step = padded.view(blocks, INT4.block).amax(dim=1) / INT4.qmax
    return (step / 2).repeat_interleave(INT4.block)[: row.numel()]


def error_bounds(inputs: list[torch.Tensor], two_levels: bool) -> list[torch.Tensor]:
    """Each rank's largest possible deviation from the exact chunk sum: every rounding the
    inputs go through (node level: each rank's piece; cross level: each node's partial sums,
    whose blocks may be larger than the exact ones by the node level's error)."""
    if not two_levels:
        return [
            sum(half_steps(x.view(WORLD, CHUNK)[r].float()) for x in inputs) for r in range(WORLD)
        ]
    nodes = WORLD // NODE
    bounds = []
    for r in range(WORLD):
        g, place = divmod(r, NODE)
        views = [x.float().view(nodes, NODE, CHUNK) for x in inputs]
        first = [half_steps(v[:, place, :].reshape(-1)).view(nodes, CHUNK)[g] for v in views]
        second = torch.zeros(CHUNK)
        for node in range(nodes):
            members = range(node * NODE, (node + 1) * NODE)
            partial = sum(views[m][g, place, :] for m in members)
            slack = sum(first[m] for m in members)
            second += half_steps(partial.abs() + slack)
        bounds.append(sum(first) + second)
    return bounds


def exact_chunks(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    total = sum(x.float() for x in inputs)
    return list(total.view(WORLD, CHUNK))


def test_rows_match_one_payload_each() -> None:
    rows = torch.randn(3, 300) * torch.tensor([[0.1], [1.0], [50.0]])
    payloads = quantize_rows(rows, INT4)
    assert payloads.shape == (3, INT4.payload_nbytes(300))
    for i in range(3):
        assert torch.equal(payloads[i], quantize(rows[i], INT4))
    assert torch.equal(
        dequantize_rows(payloads, 300, INT4)[1], dequantize_rows(payloads[1:2], 300, INT4)[0]
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("two_levels", [True, False], ids=["2x2", "one-level"])
def test_within_int4_bound_bytes_and_overflow(dist_pool: Pool, two_levels: bool) -> None:
    results = dist_pool(WORLD).run(grad_ranks.direct_calls, two_levels)
    inputs = [source_of(r, WORLD * CHUNK) for r in range(WORLD)]
    exact, bounds = exact_chunks(inputs), error_bounds(inputs, two_levels)
    for r, result in enumerate(results):
        error = (result["fp32"] - exact[r]).abs()
        assert torch.all(error <= bounds[r] + 1e-5), f"rank {r}: {(error - bounds[r]).max()}"
        assert error.max() > 0  # it was quantized: not a plain reduce-scatter
    # bf16 in, bf16 out, summed in fp32 (the bound of the bf16 inputs plus the output's rounding)
    inputs16 = [source_of(r, WORLD * CHUNK, torch.bfloat16) for r in range(WORLD)]
    exact16, bounds16 = exact_chunks(inputs16), error_bounds(inputs16, two_levels)
    for r, result in enumerate(results):
        assert result["bf16"].dtype == torch.bfloat16
        error = (result["bf16"].float() - exact16[r]).abs()
        assert torch.all(error <= bounds16[r] + exact16[r].abs() / 128 + 1e-5)
    # bytes: one all_to_all_single per level, int4 payloads, no reduce_scatter_tensor
    for result in results:
        volume = result["volume"]
        if two_levels:
            level1 = NODE * INT4.payload_nbytes(WORLD * CHUNK // NODE)
            level2 = (WORLD // NODE) * INT4.payload_nbytes(CHUNK)
            assert volume == {
                "all_to_all_single/2": {
                    "count": 2,
                    "bytes": level1 + level2,
                    "bus_bytes": (level1 + level2) / 2,
                }
            }
        else:
            assert set(volume) == {"all_to_all_single/4"}
            assert volume["all_to_all_single/4"]["bytes"] == WORLD * INT4.payload_nbytes(CHUNK)
    # an inf on rank 1 in rank 3's chunk reaches rank 3 as non-finite values; ranks 0 and 2,
    # whose pieces never shared a block with it, stay finite
    assert not torch.isfinite(results[3]["overflow"][7])
    assert torch.isfinite(results[0]["overflow"]).all()
    assert torch.isfinite(results[2]["overflow"]).all()


def accumulated_error(outputs: list[list[torch.Tensor]], exact: list[torch.Tensor]) -> float:
    """The norm over ranks of (sum of the outputs - calls x the exact chunk)."""
    total = 0.0
    for r, rank_outputs in enumerate(outputs):
        drift = sum(rank_outputs) - len(rank_outputs) * exact[r]
        total += float(drift.norm() ** 2)
    return total**0.5


@pytest.mark.timeout(120)
def test_loco_cancels_accumulated_error_and_resets(dist_pool: Pool) -> None:
    pool = dist_pool(WORLD)
    exact = exact_chunks([source_of(r, WORLD * CHUNK) for r in range(WORLD)])
    calls = 30
    for two_levels in (True, False):
        plain = pool.run(grad_ranks.repeated_calls, two_levels, calls, None)
        loco = pool.run(grad_ranks.repeated_calls, two_levels, calls, LocoSettings(0.8, 1000))
        # without feedback the same input rounds the same way every call: the error grows
        # linearly; with it the errors telescope ((e_0 - e_T) / (1 - beta))
        drift_plain = accumulated_error([r["outputs"] for r in plain], exact)
        drift_loco = accumulated_error([r["outputs"] for r in loco], exact)
        assert drift_loco < 0.3 * drift_plain, (two_levels, drift_loco, drift_plain)
        assert not plain[0]["buffers"]
    # reset_T=3: the 4th reduction starts from cleared buffers, so it repeats the 1st
    results = pool.run(grad_ranks.repeated_calls, True, 5, LocoSettings(0.8, 3))
    for result in results:
        outputs, buffers = result["outputs"], result["buffers"]
        assert torch.equal(outputs[3], outputs[0])
        assert not torch.equal(outputs[1], outputs[0])
        for after_fourth, after_first in zip(buffers[3], buffers[0], strict=True):
            assert torch.equal(after_fourth, after_first)
        assert all(b.abs().sum() > 0 for b in buffers[2])
        # fp32 buffers: the node level's is the whole source, the cross level's 1/k of it
        assert [tuple(b.shape) for b in buffers[0]] == [
            (NODE, WORLD * CHUNK // NODE),
            (WORLD // NODE, CHUNK),
        ]
        assert all(b.dtype == torch.float32 for b in buffers[0])
    # an overflowing reduction reports non-finite values but leaves the buffers finite
    after = pool.run(grad_ranks.loco_after_overflow)
    assert not torch.isfinite(after[3]["overflow"][7])
    for result in after:
        assert result["finite_buffers"]
        assert torch.isfinite(result["after"]).all()


def _theory(buckets: list[int]) -> tuple[int, int]:
    """qgZ's message bytes per step at each level, from the padded bucket sizes."""
    level1 = sum(NODE * INT4.payload_nbytes(size // NODE) for size in buckets)
    level2 = sum((WORLD // NODE) * INT4.payload_nbytes(size // WORLD) for size in buckets)
    return level1, level2


@pytest.mark.timeout(180)
def test_training_bytes_equal_theory(dist_pool: Pool, tmp_path: Path) -> None:
    pool = dist_pool(WORLD)
    steps = 2
    plain = pool.run(grad_ranks.train_steps, {}, steps)
    qgz: dict[str, Any] = {
        "zero_quantized_gradients": True,
        "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
    }
    quantized = pool.run(grad_ranks.train_steps, qgz, steps, reload=str(tmp_path))
    buckets = plain[0]["buckets"]
    assert quantized[0]["buckets"] == buckets
    level1, level2 = _theory(buckets)
    for rank in range(WORLD):
        for step in range(steps):
            plain_volume = plain[rank]["volume"][step]
            volume = quantized[rank]["volume"][step]
            full = plain_volume["reduce_scatter_tensor/4"]
            assert full["bytes"] == 4 * sum(buckets)  # fp32 gradients
            assert not any(key.startswith("reduce_scatter") for key in volume)
            assert "all_to_all_single/4" not in volume  # only node-sized groups
            reduce = volume["all_to_all_single/2"]
            assert reduce["count"] == 2 * len(buckets)
            assert reduce["bytes"] == level1 + level2
            # bus bytes: 1/8 of fp32's (int4, half the group each level) plus scales and the
            # padding of each piece to whole 256-blocks (0.16 for these small buckets)
            ratio = reduce["bus_bytes"] / full["bus_bytes"]
            assert 0.125 <= ratio < 0.2, ratio
        # LoCo's fp32 buffers: (1 + 1/k) x the padded gradient, on every rank
        assert quantized[rank]["error_bytes"] == 4 * sum(s + s // NODE for s in buckets)
        # not checkpointed: a load restarts them at zero, as a reset_T boundary does
        assert quantized[rank]["errors_after_load"] == 0
        assert quantized[rank]["loss"][0] == pytest.approx(plain[rank]["loss"][0], rel=1e-6)
        assert quantized[rank]["loss"][1] == pytest.approx(plain[rank]["loss"][1], rel=2e-2)
    # one level (a node holds every rank): one int4 all-to-all over the 4 ranks per bucket
    single = pool.run(grad_ranks.train_steps, {"zero_quantized_gradients": True}, 1, node=WORLD)
    for result in single:
        volume = result["volume"][0]
        assert not any(k.startswith("reduce_scatter") or k.endswith("/2") for k in volume)
        assert volume["all_to_all_single/4"]["count"] == len(buckets)
        expected = sum(WORLD * INT4.payload_nbytes(size // WORLD) for size in buckets)
        assert volume["all_to_all_single/4"]["bytes"] == expected
        assert result["error_bytes"] == 0  # no LoCo asked
