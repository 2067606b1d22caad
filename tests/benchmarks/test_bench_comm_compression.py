"""benchmarks/bench_comm_compression.py at tiny sizes on 2 gloo ranks: one JSON line with every
mode, the 1-bit optimizers moving under a tenth of ZeRO-0's bytes after the freeze, the torch
DDP peer's counted bytes equal to ZeRO-0's, finite losses and the modelled link figures."""

from __future__ import annotations

import math

import pytest

from tests.benchmarks.tiny_run import tiny_run

MODES = ["zero0_adam", "torch_ddp", "zero3_adam", "onebit_adam", "zero_one_adam", "onebit_lamb"]


@pytest.mark.timeout(240)
def test_tiny_run_reports_every_mode() -> None:
    out = tiny_run("bench_comm_compression.py", timeout=220)
    assert "modelled" in out["link_model"]
    zero0 = out["zero0_adam"]["bus_bytes_per_step"]
    # an fp32 all-reduce of every parameter: 2(n-1)/n * 4 bytes * params on the bus
    assert zero0 == pytest.approx(4 * out["params"], rel=0.05)
    for mode in MODES:
        figures = out[mode]
        assert figures["step_s"] > 0 and figures["compute_s"] > 0, (mode, figures)
        assert math.isfinite(figures["final_loss"]), (mode, figures)
        assert set(figures["modelled_step_s"]) == {"at_link_gbps", "at_gpu_ratio"}, mode
        assert figures["bytes_vs_zero0"] == pytest.approx(
            figures["bus_bytes_per_step"] / zero0, abs=1e-3
        )
    # the DDP hook's count and shardspeed.comm's agree on the same all-reduce
    assert out["torch_ddp"]["bus_bytes_per_step"] == zero0
    for mode in ["onebit_adam", "zero_one_adam", "onebit_lamb"]:
        assert 0 < out[mode]["bus_bytes_per_step"] < zero0 / 10, (mode, out[mode])
        # fewer bytes over the (slow, modelled) link: a shorter modelled step at the GPU ratio
        assert out[mode]["modelled_speedup_vs_zero0"]["at_gpu_ratio"] > 1, (mode, out[mode])


@pytest.mark.timeout(300)
def test_tiny_zeropp_run_cuts_inter_node_bytes() -> None:
    # the three modes together against ZeRO-3 (each mode's bytes are tests/runtime/zeropp/'s)
    modes = "zero3_adam,zeropp_all"
    out = tiny_run(
        "bench_comm_compression.py", 280, "--world", "4", "--node", "2", "--modes", modes
    )
    assert out["ranks_per_node"] == 2
    zero3, zeropp = out["zero3_adam"], out["zeropp_all"]
    assert zero3["inter_node_bytes_per_step"] > 0
    assert zero3["inter_node_bytes_vs_zero3"] == 1
    assert math.isfinite(zeropp["final_loss"]), zeropp
    # hpZ's backward gathers stay in the node, qwZ sends int8, qgZ int4
    assert zeropp["inter_node_bytes_vs_zero3"] < 0.35, zeropp
    assert zeropp["bus_bytes_per_step"] < zero3["bus_bytes_per_step"], zeropp
