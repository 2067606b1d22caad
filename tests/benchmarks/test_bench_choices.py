"""benchmarks/bench_choices.py at tiny sizes: with prefix caching each prompt is computed once
for its n choices (the others compute only the tokens past its last full cached block), and
every sampled choice draws the same tokens as without sharing."""

from __future__ import annotations

import pytest

from tests.benchmarks.tiny_run import tiny_run


@pytest.mark.timeout(240)
def test_tiny_run_computes_each_prompt_once() -> None:
    out = tiny_run("bench_choices.py", 220)
    assert out["workload"] == {
        "prompts": 2, "n": 3, "prompt_len": 40, "new_tokens": 4, "token_budget": 512
    }  # fmt: skip
    fed = 6 * 3  # each choice's first 3 tokens are fed back
    # shared: 2 prompts of 40, then 4 siblings x the 8 tokens past 2 cached blocks of 16
    assert out["results"]["shared"]["computed_tokens"] == 2 * 40 + 4 * 8 + fed
    assert out["results"]["unshared"]["computed_tokens"] == 6 * 40 + fed
    assert out["choices_equal"] == out["choices"] == 6
