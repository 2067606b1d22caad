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


ZEROPP = ["zeropp_hpz", "zeropp_qwz", "zeropp_qgz", "zeropp_all"]


@pytest.mark.timeout(300)
def test_tiny_zeropp_run_cuts_inter_node_bytes() -> None:
    modes = ",".join(["zero3_adam", *ZEROPP])
    out = tiny_run(
        "bench_comm_compression.py", 280, "--world", "4", "--node", "2", "--modes", modes
    )
    assert out["ranks_per_node"] == 2
    zero3 = out["zero3_adam"]
    assert zero3["inter_node_bytes_per_step"] > 0
    for mode in ZEROPP:
        figures = out[mode]
        assert math.isfinite(figures["final_loss"]), (mode, figures)
        assert figures["inter_node_bytes_vs_zero3"] < 1, (mode, figures)
    # hpZ's backward gathers stay in the node, qwZ sends int8, qgZ int4; together the least
    assert out["zeropp_all"]["inter_node_bytes_vs_zero3"] < 0.35, out["zeropp_all"]
