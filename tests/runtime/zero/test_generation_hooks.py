"""ZeRO-3's module hooks taken off and put back around a whole-model forward, as TRL's
``unwrap_model_for_generation`` does through ``engine.optimizer.parameter_offload`` (2 gloo
ranks; the rank-side code is in ``generation_hooks_ranks.py``)."""

from __future__ import annotations

import pytest

from tests.runtime.zero import generation_hooks_ranks


@pytest.mark.timeout(180)
def test_generate_with_hooks_removed_then_train_as_without(dist_pool):
    dist_pool(2).run(generation_hooks_ranks.generate_with_hooks_removed)


@pytest.mark.timeout(180)
def test_coordinator_reregistration_and_deepspeed_views(dist_pool):
    dist_pool(2).run(generation_hooks_ranks.coordinator_and_views)


@pytest.mark.timeout(180)
def test_forward_without_hooks_on_released_parameters_is_refused(dist_pool):
    messages = dist_pool(2).run(generation_hooks_ranks.refuses_released_parameters)
    for message in messages:
        # names the module whose parameters were released, and both ways out
        assert "wte (Embedding)" in message and "_register_deepspeed_module" in message
