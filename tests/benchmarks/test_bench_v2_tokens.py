"""benchmarks/bench_v2_tokens.py at tiny sizes: in float32 HF's static batches and v2 keep HF's
tokens alone for every request; the lower-precision figures are counts within range."""

from __future__ import annotations

import pytest

from tests.benchmarks.tiny_run import tiny_run


@pytest.mark.timeout(180)
def test_tiny_run_counts_kept_tokens_per_path() -> None:
    out = tiny_run("bench_v2_tokens.py", 160)
    assert out["benchmark"] == "v2_tokens" and out["dtype"] == "bfloat16"
    kept = out["vs_hf_alone_float32"]
    assert set(kept) == {
        "hf_batched_float32",
        "v2_float32",
        "hf_alone_bfloat16",
        "hf_batched_bfloat16",
        "v2_bfloat16",
    }
    # float32 is the baseline's own precision: every path gives its tokens
    for path in ("hf_batched_float32", "v2_float32"):
        assert kept[path] == {"equal": 6, "kept_share": 1.0}, path
    for figures in [*kept.values(), *out["between"].values()]:
        assert 0 <= figures["equal"] <= 6 and 0.0 <= figures["kept_share"] <= 1.0
        # every equal request keeps all its tokens
        assert figures["kept_share"] >= figures["equal"] / 6 - 1e-9
