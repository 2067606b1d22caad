"""``engine.compile()``: the wrapped model compiled in place trains as the eager one does
(through AOTAutograd: ``aot_eager`` traces forward and backward like inductor, without its
code generation, so the test stays fast), at ZeRO 0 and 2 on 2 ranks."""

from __future__ import annotations

import pytest

from tests.runtime import compile_ranks


@pytest.mark.parametrize("stage", [0, 2])
def test_compiled_engine_trains_as_eager(dist_pool, stage: int):
    curves = dist_pool(2).run(compile_ranks.compiled_matches_eager, stage)
    assert curves[0][-1] < curves[0][0]


def test_deepcompile_options_refused(dist_pool):
    message = dist_pool(2).run(compile_ranks.deepcompile_refused)[0]
    assert "DeepCompile" in message
