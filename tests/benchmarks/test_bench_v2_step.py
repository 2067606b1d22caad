"""benchmarks/bench_v2_step.py at tiny sizes: one JSON line with every step figure, for every
number of running sequences asked for."""

from __future__ import annotations

import pytest

from tests.benchmarks.tiny_run import tiny_run


@pytest.mark.timeout(120)
def test_tiny_run_times_every_step_kind() -> None:
    out = tiny_run("bench_v2_step.py", 100)
    assert out["benchmark"] == "v2_step" and out["device"] == "cpu"
    steps = out["ms_per_step_by_sequences"]
    assert set(steps) == {"2", "4"}
    for figures in steps.values():
        assert set(figures) == {
            "v2_step",
            "v2_put",
            "v2_mixed_put",
            "v2_metadata",
            "hf_generate",
            "v1_fused",
        }
        assert all(ms > 0 for ms in figures.values()), figures
        # the metadata is part of a put, and a put part of a scheduler step
        assert figures["v2_metadata"] < figures["v2_put"]
