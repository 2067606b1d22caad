"""PipelineEngine behaviour on real gloo ranks: activation memory under 1F1B, eval_batch,
errors on every rank without hangs."""

from __future__ import annotations

import pytest

from tests.runtime.pipe import ranks


def test_live_activations_bounded_by_pipe_buffers(dist_pool):
    """8 micro-batches on 2 stages: GPipe would keep 8 micro-batches of activations; 1F1B keeps
    at most num_pipe_buffers() (2) on each stage, 1 on the last, and none after the batch."""
    results = dist_pool(2).run(ranks.activation_memory, 8)
    first, last = results
    assert first["peak"] <= first["buffers"] == 2
    assert last["peak"] == 1 <= last["buffers"]
    assert all(r["alive_after"] == 0 for r in results)


def test_eval_batch_matches_single_process(dist_pool):
    dist_pool(2).run(ranks.eval_matches_reference)


def test_errors_raise_on_every_rank(dist_pool):
    dist_pool(2).run(ranks.errors_are_clear_everywhere, timeout_s=120)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_follows_fp32(dist_pool, tmp_path, dtype):
    losses = dist_pool(2).run(ranks.low_precision, dtype, str(tmp_path))
    assert losses[0] == losses[1]
    written = (tmp_path / "pipe" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert len(written) == 1 + len(losses[0])  # a header, then one row per batch


@pytest.mark.parametrize("dynamic", [False, True], ids=["cached", "dynamic_shape"])
def test_changing_input_shapes(dist_pool, dynamic):
    dist_pool(2).run(ranks.changing_shapes, dynamic)


def test_module_builds_only_its_stage(dist_pool):
    dist_pool(2).run(ranks.module_api)


def test_tuple_messages_and_batch_fn(dist_pool):
    dist_pool(2).run(ranks.tuple_messages)


def test_checkpointable_layers_and_compile(dist_pool):
    """2 steps x 2 micro-batches: a checkpointed layer runs its forward twice per micro-batch
    (forward and recompute), the others once; compile() keeps parity."""
    for counts in dist_pool(2).run(ranks.checkpointable_layers_and_compile):
        blocks = [v for k, v in counts.items() if k.endswith(":Block")]
        if blocks:  # this stage holds blocks
            assert counts.get("Block:Block") == 2 * counts["LayerNorm:Block"]
        norms = [k for k in counts if k.endswith(":LayerNorm")]
        if norms:
            assert counts["LayerNorm:LayerNorm"] == 2 * counts["Block:LayerNorm"]
        assert counts["compiled"] == 1


def test_output_shape_change_without_dynamic_shape_stops_every_rank(dist_pool):
    for message in dist_pool(2).run(ranks.output_shape_change_stops_every_rank):
        assert "ActivationShapeError" in message and "dynamic_shape=True" in message, message
