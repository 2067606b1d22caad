"""AutoEP on 2 gloo ranks, ``autoep_size`` 2: small Mixtral, Qwen3-MoE, Qwen2-MoE and
DeepSeek-V3 models built from configs equal the unmodified model, forward and in training."""

from __future__ import annotations

import pytest
import torch

from tests.moe.autoep import autoep_ranks


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen3_moe", "qwen2_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3"]
)
def test_forward_equals_unmodified_model(dist_pool, family: str):
    errors = dist_pool(2).run(autoep_ranks.forward_parity, family)
    assert all(e["logits"] < 1e-5 and e["router_logits"] < 1e-5 for e in errors), errors


@pytest.mark.parametrize("sigmoid_groups", [False, True])
def test_custom_model_with_linear_router(dist_pool, sigmoid_groups: bool):
    errors = dist_pool(2).run(autoep_ranks.custom_parity, sigmoid_groups)
    assert all(e["output"] < 1e-5 for e in errors), errors


@pytest.mark.parametrize(
    ("family", "stage", "ep_size"),
    [("mixtral", 0, 2), ("mixtral", 2, 2), ("qwen3_moe", 0, 2), ("qwen3_moe", 2, 2),
     ("qwen3_moe", 1, 2), ("mixtral", 2, 1)],
)  # fmt: skip
def test_training_equals_data_parallel(dist_pool, family: str, stage: int, ep_size: int):
    results = dist_pool(2).run(autoep_ranks.training_parity, family, stage, ep_size)
    losses = [r["losses"] for r in results]
    assert all(len(rank_losses) == 10 for rank_losses in losses)
    assert losses[0][-1] < losses[0][0]


def test_a_rank_without_tokens(dist_pool):
    errors = dist_pool(2).run(autoep_ranks.empty_rank_parity)
    assert max(errors) < 1e-5


def test_training_with_expert_data_parallel_groups(dist_pool):
    """4 ranks, autoep_size 2: each expert slice is held by 2 ranks and reduced over them."""
    results = dist_pool(4).run(autoep_ranks.training_parity, "qwen3_moe", 2)
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def test_refusals(dist_pool):
    messages = dist_pool(2).run(autoep_ranks.refusals)[0]
    expected = {
        "autotp": "autotp_size",
        "mpu_tp": "tensor model parallelism",
        "deepseek_lb": "load_balance_coeff to null",
        "world": "divide the world size",
        "experts": "must divide the 3 experts",
        "preset": "not an AutoEP preset",
        "routing_key": "routes by itself",
    }
    for case, fragment in expected.items():
        assert fragment in messages[case], (case, messages[case])


def test_checkpoint_resumes_at_another_autoep_size(dist_pool, tmp_path):
    """Saved at autoep_size 2 (ZeRO 2, 2 ranks: experts split in two), resumed in parity at
    autoep_size 1 and under ZeRO 1, and on 4 ranks at autoep_size 4 (one expert row each)."""
    from tests.moe.autoep import checkpoint_ranks

    folder = str(tmp_path)
    dist_pool(2).run(checkpoint_ranks.train_side_by_side, folder, 2, 2, 3, 0, False)
    names = {p.name for p in (tmp_path / "autoep" / "t").iterdir()}
    assert "layer_0_expert_3_mp_rank_00_model_states.pt" in names
    # zero_to_fp32 stacks each fused tensor's expert rows back: the unmodified model's weights
    from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    merged = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "autoep", "t")
    plain = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "plain", "t")
    assert merged.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-5, msg=name)
    whole = torch.load(tmp_path / "autoep16.pt", weights_only=True)
    expected = torch.load(tmp_path / "plain16.pt", weights_only=True)
    assert whole.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(whole[name], value, rtol=1e-5, atol=1e-5, msg=name)
    dist_pool(2).run(checkpoint_ranks.train_side_by_side, folder, 1, 1, 3, 3, True)
    dist_pool(4).run(checkpoint_ranks.train_side_by_side, folder, 2, 4, 3, 3, True)


def test_parameter_list_built_before_initialize_is_refused(dist_pool):
    from tests.moe.autoep import checkpoint_ranks

    message = dist_pool(2).run(checkpoint_ranks.stale_parameters)[0]
    assert "not in the model after AutoEP" in message
