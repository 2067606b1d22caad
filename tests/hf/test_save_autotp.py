"""Whole 16-bit weights from an AutoTP engine (``tensor_parallel.autotp_size`` 2 on 2 ranks) at
ZeRO 0-3: ``_zero3_consolidated_16bit_state_dict``, ``_consolidated_16bit_state_dict``
(what Accelerate's ``get_state_dict`` calls under AutoTP) and ``save_16bit_model`` give every
tensor-parallel piece assembled, equal to the engine's parameters gathered whole; a tied head
stays one tensor; only rank 0 writes. The Trainer's ``"auto"`` batch count (every rank,
tensor-parallel peers too) is accepted and read as the real global batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf import autotp_save_ranks

pytest.importorskip("transformers")

CASES = [("llama", 0), ("qwen2", 1), ("llama", 2), ("qwen2", 3)]


@pytest.mark.timeout(240)
def test_autotp_16bit_weights_are_whole_at_every_stage(dist_pool, tmp_path: Path) -> None:
    ranks = dist_pool(2).run(autotp_save_ranks.save_cases, str(tmp_path), CASES, timeout_s=220)
    for rank, results in enumerate(ranks):
        *per_case, last = results
        for result in per_case:
            what = (rank, *result["case"])
            # fp32 training dtype: the gathered weights are the parameters, bit for bit
            assert result["zero3_dict"] == 0.0, what
            assert result["consolidated"] == 0.0, what
            assert result["saved"] is True, what
            assert result["tied_kept"], what
            # one data-parallel rank: the global batch is one micro-batch
            assert result["train_batch_size"] == autotp_save_ranks.MICRO, what
            if rank == 0:
                assert result["file"] == 0.0, what
                assert result["file_keys"] == result["model_keys"], what
        # ZeRO-3 without stage3_gather_16bit_weights_on_model_save: nothing written
        assert last["not_gathered"] is False
        assert "autotp_size" in last["unsplit_error"]
    assert not (tmp_path / "none").exists()
