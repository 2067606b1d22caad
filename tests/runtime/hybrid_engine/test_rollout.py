"""``runtime.rollout``: the rollout interface and the hybrid-engine rollout."""

from __future__ import annotations

import pytest
import torch

from shardspeed.runtime.rollout import (
    HybridEngineRollout,
    HybridEngineRolloutConfig,
    RolloutBatch,
    RolloutRequest,
    SamplingConfig,
    VLLMRollout,
)
from shardspeed.runtime.rollout.hybrid_engine_rollout import pad_after_eos
from tests.runtime.hybrid_engine.ranks import rollout_case


def test_pad_after_eos_keeps_the_first_eos_and_masks_the_rest():
    output = torch.tensor([[7, 7, 1, 5, 2, 5], [7, 7, 1, 2, 3, 4]])
    padded, mask = pad_after_eos(output, start=2, eos=5, pad=0)
    assert padded.tolist() == [[7, 7, 1, 5, 0, 0], [7, 7, 1, 2, 3, 4]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="must match"):
        RolloutRequest(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="one entry per row"):
        RolloutBatch(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="at least 1"):
        SamplingConfig(max_new_tokens=0)


def test_what_is_not_built_is_refused():
    with pytest.raises(NotImplementedError, match="HybridEngineRollout"):
        VLLMRollout()
    with pytest.raises(NotImplementedError, match="use_graph_capture"):
        HybridEngineRollout(None, None, HybridEngineRolloutConfig(use_graph_capture=True))


@pytest.mark.timeout(240)
def test_hybrid_engine_rollout_under_zero3(dist_pool):
    for rank in dist_pool(2).run(rollout_case):
        assert rank["shape"] == (4, 10)  # 2 prompts x 2 samples, 4 + 6 tokens
        assert rank["equal"]  # greedy: the unpartitioned model's tokens
        assert rank["starts"] == [4, 4, 4, 4]
        assert rank["mask_all"]
        assert rank["sampled_shape"] == (2, 9)
