"""register_with_transformers on tiny Llama / Qwen2 models (2 and 4 gloo ranks): logits slices
and summed parameter gradients equal the whole-sequence model in one process; the mpu's groups
are utils.groups'; bad calls raise errors that name the fix."""

from __future__ import annotations

import inspect

import pytest

from shardspeed.runtime.sequence_parallel import ulysses_sp
from tests.runtime.sequence_parallel import attention_ranks, hf_model_ranks

# (world, arch, core, query heads, key/value heads, mode)
MODELS = [
    (2, "llama", "sdpa", 4, 2, "ulysses"),
    (2, "qwen2", "eager", 4, 2, "ulysses"),
    (2, "llama", "eager", 3, 3, "ring"),
    (4, "llama", "eager", 4, 4, "ulysses"),
    (4, "qwen2", "sdpa", 4, 1, "ulysses"),  # MQA, the kv head replicated x4
    (4, "llama", "sdpa", 6, 2, "ulysses x ring"),  # the 6 q / 2 kv heads at sp 4
    (4, "qwen2", "eager", 3, 3, "ring"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "arch", "core", "q_heads", "kv_heads", "mode"), MODELS)
def test_model_on_slices_equals_whole(dist_pool, world, arch, core, q_heads, kv_heads, mode):
    modes = dist_pool(world).run(hf_model_ranks.model_equals_whole, arch, core, q_heads, kv_heads)
    assert modes == [mode] * world


@pytest.mark.timeout(120)
def test_mpu_groups_match_utils_groups(dist_pool):
    """sp 2 on 4 ranks: sequence groups of consecutive ranks, data parallel across them."""
    results = dist_pool(4).run(hf_model_ranks.groups_match, 2)
    assert [r["sp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert {(r["sp_size"], r["dp_size"]) for r in results} == {(2, 2)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("sp_not_dividing", "does not divide the world size"),
        ("core", "'flash_attention_2' is not supported"),
        ("fixed_without_length", "`seq_length` needs to be"),
        ("length_not_dividing", "is not divisible by sequence_parallel_size"),
    ],
)
def test_bad_registration_is_refused(dist_pool, case, text):
    messages = dist_pool(2).run(hf_model_ranks.registration_error, case)
    assert all(text in m for m in messages), messages


@pytest.mark.timeout(120)
def test_sp_one_registers_nothing(dist_pool):
    assert dist_pool(2).run(hf_model_ranks.sp_one_is_a_no_op) == [True, True]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("core", ["sdpa", "eager"])
def test_disable_in_eval_attends_within_the_slice(dist_pool, core):
    assert dist_pool(2).run(hf_model_ranks.disable_in_eval, core) == [True, True]


@pytest.mark.timeout(120)
def test_fixed_length_is_checked(dist_pool):
    message = dist_pool(2).run(attention_ranks.fixed_length_checked)[0]
    assert "expected local_seq_length=4" in message


@pytest.mark.timeout(120)
def test_position_ids_are_required(dist_pool):
    message = dist_pool(2).run(attention_ranks.position_ids_required)[0]
    assert "needs position_ids" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("core", "q_heads", "outcome"),
    [
        ("eager", 4, "exact"),  # documents kept apart by the mask built from positions
        ("sdpa", 4, "not supported with the sdpa core"),
        ("eager", 3, "not supported with ring attention"),
    ],
)
def test_packed_sequences(dist_pool, core, q_heads, outcome):
    results = dist_pool(2).run(attention_ranks.packed_documents, core, q_heads)
    assert all(outcome in r for r in results), results


def test_deepspeed_path_and_signatures():
    cls = ulysses_sp.UlyssesSPAttentionHF
    assert list(inspect.signature(cls.__init__).parameters) == [
        "self",
        "attn",
        "batch_size",
        "attn_head_count",
        "attn_head_size",
        "kv_head_count",
        "num_hidden_layers",
        "process_group",
        "seq_length_is_variable",
        "local_seq_length",
        "global_seq_length",
        "disable_in_eval",
    ]
    register = inspect.signature(cls.register_with_transformers).parameters
    assert list(register) == [
        "model_name_or_path",
        "core_attn_implementation",
        "sequence_parallel_size",
        "micro_batch_size",
        "seq_length",
        "seq_length_is_variable",
        "disable_in_eval",
    ]
    assert register["seq_length_is_variable"].default is True
    assert issubclass(ulysses_sp.SequenceParallelInputError, AssertionError)
