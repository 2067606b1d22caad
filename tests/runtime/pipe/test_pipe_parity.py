"""Pipeline training equals single-process training of the same layers (a GPT-style model with
the token embedding tied to the output projection across stages), step by step: losses and
every stage's parameters within rtol 1e-5, gradient accumulation 4, clipping by the global
norm on."""

from __future__ import annotations

import pytest

from tests.runtime.pipe import ranks

STEPS = 10


@pytest.mark.parametrize(
    ("world", "stages"), [(2, 2), (4, 2), (4, 4)], ids=["pipe2", "pipe2xdata2", "pipe4"]
)
def test_matches_single_process(dist_pool, world, stages):
    losses = dist_pool(world).run(ranks.train_parity, stages, steps=STEPS)
    assert all(rank == losses[0] for rank in losses)  # the loss reaches every stage
    assert losses[0][-1] < losses[0][0]


def test_activation_checkpointing(dist_pool):
    """Every layer recomputed in backward (activation_checkpoint_interval=1): same numbers."""
    dist_pool(2).run(
        ranks.train_parity, 2, steps=STEPS, module_kwargs={"activation_checkpoint_interval": 1}
    )


def test_zero_stage1_with_data_parallel(dist_pool):
    """ZeRO stage 1 partitions each stage's optimizer state over its data-parallel pair."""
    dist_pool(4).run(ranks.train_parity, 2, steps=STEPS, zero_optimization={"stage": 1})


def test_config_checkpoint_interval_and_zero1_on_pipe4(dist_pool):
    """The ``pipeline`` section's activation_checkpoint_interval applies to the module."""
    dist_pool(4).run(
        ranks.train_parity,
        4,
        steps=4,
        zero_optimization={"stage": 1},
        pipeline={"activation_checkpoint_interval": 1, "stages": 4},
    )
