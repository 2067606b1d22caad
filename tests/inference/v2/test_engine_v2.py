"""InferenceEngineV2 against each family's own Hugging Face forward and generate (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from shardspeed.inference.v2 import (
    InferenceEngineV2,
    RaggedInferenceEngineConfig,
    SchedulingError,
    SchedulingResult,
    build_hf_engine,
)
from shardspeed.inference.v2.model import SUPPORTED_FAMILIES, RaggedCausalLM
from tests.inference.v2 import hf_models as hm

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "gpt2", "mistral-window"]
ATOL = 1e-4


def make_engine(model: Any, blocks: int = 64, block: int = 4, **state: Any) -> InferenceEngineV2:
    state = {
        "kv_block_size": block,
        "max_context": 256,
        "memory_config": {"mode": "allocate", "size": blocks},
    } | state
    return build_hf_engine(model, {"state_manager": state})


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, hm.build(request.param)


def test_ragged_batches_match_hf_forward(family_model: tuple[str, Any]) -> None:
    """New prompts, chunks of a long prompt over several puts and decode tokens, mixed in ragged
    batches: every returned row equals HF's logits of that sequence's whole token run."""
    family, model = family_model
    engine = make_engine(model)
    long = hm.tokens(41, seed=1)
    seqs = {1: long[:0], 2: long[:0], 3: long[:0], 4: long[:0]}
    steps = [
        {1: hm.tokens(9, 2), 2: long[:16], 3: hm.tokens(1, 3)},  # three new sequences
        {2: long[16:17], 3: hm.tokens(1, 4), 4: hm.tokens(12, 5)},  # 1 token of a chunk, new
        {2: long[17:41], 1: hm.tokens(1, 6), 4: hm.tokens(3, 7)},  # last chunk + decode
        {1: hm.tokens(1, 8), 2: hm.tokens(1, 9), 3: hm.tokens(1, 10), 4: hm.tokens(1, 11)},
    ]
    for step in steps:
        logits = engine.put(list(step), list(step.values()))
        assert logits.shape == (len(step), hm.VOCAB) and logits.dtype == torch.float32
        for row, (uid, run) in enumerate(step.items()):
            seqs[uid] = torch.cat([seqs[uid], run])
            want = hm.last_logits(model, seqs[uid])
            hm.assert_close(logits[row], want, atol=ATOL, rtol=0)
    assert engine.seen_tokens(2) == 42


def test_greedy_loop_matches_hf_generate(family_model: tuple[str, Any]) -> None:
    """Prompts of different lengths decoded together, one token each per put, give exactly the
    tokens of HF generate(do_sample=False) run on each prompt alone."""
    family, model = family_model
    engine = make_engine(model)
    prompts = {7: hm.tokens(5, 20), 8: hm.tokens(14, 21), 9: hm.tokens(23, 22)}
    new_tokens = 10
    got: dict[int, list[int]] = {uid: [] for uid in prompts}
    logits = engine.put(list(prompts), list(prompts.values()))
    for _ in range(new_tokens):
        nxt = logits.argmax(dim=-1)
        for uid, tok in zip(prompts, nxt.tolist(), strict=True):
            got[uid].append(tok)
        logits = engine.put(list(prompts), [t.view(1) for t in nxt])
    for uid, ids in prompts.items():
        assert got[uid] == hm.greedy(model, ids, new_tokens), (family, uid)


def test_sliding_window_is_applied() -> None:
    """The window matters on these prompts (a window-less model's logits differ) and the engine
    follows it (the ragged-batch test above checks equality with HF's windowed forward)."""
    windowed, full = hm.build("mistral-window"), hm.build("mistral")
    ids = hm.tokens(30, 30)
    assert (hm.last_logits(windowed, ids) - hm.last_logits(full, ids)).abs().max() > 1e-3
    got = make_engine(windowed).put([1], [ids])[0]
    hm.assert_close(got, hm.last_logits(windowed, ids), atol=ATOL, rtol=0)


def test_mixtral_router_matches_hf() -> None:
    """The MoE router sees the same hidden states as in HF's forward: same experts chosen, same
    weights, token by token."""
    model = hm.build("mixtral")
    ids = hm.tokens(19, 40)
    seen: list[list[tuple[torch.Tensor, ...]]] = [[], []]
    target = 1

    def hook(_module: Any, _inputs: Any, outputs: Any) -> None:
        seen[target].append(tuple(o.detach().clone() for o in outputs))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    try:
        # the engine first: it moves the model to the accelerator, where HF's forward then runs
        # too (the router logits are compared to 1e-5, closer than two devices agree)
        make_engine(model).put([1], [ids])
        target = 0
        hm.last_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert len(seen[0]) == len(seen[1]) == 2
    for (hf_logits, hf_scores, hf_idx), (logits, scores, idx) in zip(*seen, strict=True):
        assert torch.equal(idx.cpu(), hf_idx.cpu())
        hm.assert_close(scores, hf_scores, atol=1e-5, rtol=0)
        hm.assert_close(logits, hf_logits, atol=1e-5, rtol=0)


def test_from_local_path(tmp_path: Any) -> None:
    model = hm.build("qwen2")
    model.save_pretrained(tmp_path)
    engine = build_hf_engine(
        str(tmp_path), {"state_manager": {"memory_config": {"mode": "allocate", "size": 8}}}
    )
    ids = hm.tokens(11, 50)
    hm.assert_close(engine.put([3], [ids])[0], hm.last_logits(model, ids), atol=ATOL, rtol=0)
    assert engine.kv_block_size == 64 and engine.total_blocks == 8
    with pytest.raises(ValueError, match="not a local directory"):
        build_hf_engine(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------- limits
@pytest.fixture(scope="module")
def llama() -> Any:
    return hm.build("llama")


def small_engine(model: Any, **state: Any) -> InferenceEngineV2:
    limits = {
        "max_context": 20,
        "max_ragged_batch_size": 16,
        "max_ragged_sequence_count": 2,
        "max_tracked_sequences": 3,
        "prefix_caching": False,
    }
    return make_engine(model, blocks=8, block=4, **(limits | state))


def test_query_at_the_limits(llama: Any) -> None:
    engine = small_engine(llama)
    assert engine.query(1, 10, 8) == (10, 3)
    assert engine.query(1, 10, 2) == (8, 2)  # two blocks hold 8 tokens
    assert engine.query(1, 30, 100) == (20, 5)  # capped at max_context
    engine.put([1], [hm.tokens(5, 1)])  # 2 blocks, 3 free slots in the second
    assert engine.get_remaining_block_capacity(1) == 3
    assert engine.query(1, 3, 0) == (3, 0)
    assert engine.query(1, 4, 0) == (3, 0)
    assert engine.query(1, 4, 1) == (4, 1)
    assert engine.query(1, 100, 100) == (15, 3)  # 20 tokens: 5 blocks
    engine.put([2, 3], [hm.tokens(1, 2), hm.tokens(1, 3)])
    assert engine.query(4, 1, 1) == (0, 0)  # max_tracked_sequences reached
    assert engine.query(3, 1, 1) == (1, 0)


def test_can_schedule_at_the_limits(llama: Any) -> None:
    engine = small_engine(llama)
    engine.put([1], [hm.tokens(5, 1)])  # 6 of 8 blocks free
    ok = SchedulingResult.Success
    assert engine.can_schedule([1, 2, 3], [1, 1, 1]) == SchedulingResult.BatchSequenceLimitExceeded
    assert engine.can_schedule([2], [16]) == ok  # exactly the token limit
    assert engine.can_schedule([2], [17]) == SchedulingResult.BatchTokenLimitExceeded
    assert engine.can_schedule([1, 2], [8, 9]) == SchedulingResult.BatchTokenLimitExceeded
    assert engine.can_schedule([1], [15]) == ok  # 20 tokens: max_context exactly
    assert engine.can_schedule([1], [16]) == SchedulingResult.SequenceTokenLimitExceeded
    assert engine.can_schedule([2, 3], [16, 9]) == SchedulingResult.KVCacheLimitExceeded  # 4+3
    assert engine.can_schedule([2, 3], [16, 4]) != SchedulingResult.KVCacheLimitExceeded
    engine.put([2, 3], [hm.tokens(1, 2), hm.tokens(1, 3)])
    assert engine.can_schedule([4], [1]) == SchedulingResult.EngineSequenceLimitExceeded
    assert engine.can_schedule([3], [1]) == ok


def test_put_refuses_what_cannot_be_scheduled(llama: Any) -> None:
    engine = small_engine(llama)
    engine.put([1], [hm.tokens(5, 1)])
    free = engine.free_blocks
    for uids, runs, result, text in (
        ([1], [hm.tokens(16, 2)], "SequenceTokenLimitExceeded", "max_context=20"),
        ([2, 3], [hm.tokens(16, 3), hm.tokens(9, 4)], "KVCacheLimitExceeded", "free"),
        ([2, 3], [hm.tokens(9, 3), hm.tokens(8, 4)], "BatchTokenLimitExceeded", "batch"),
    ):
        with pytest.raises(SchedulingError, match=result) as info:
            engine.put(uids, runs)
        assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
        assert text in str(info.value)
        assert engine.free_blocks == free and not engine.tracked(2) and not engine.tracked(3)
    # max_context is checked even without do_checks, and nothing changes
    with pytest.raises(ValueError, match="max_context"):
        engine.put([1], [hm.tokens(16, 2)], do_checks=False)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.put([2, 3], [hm.tokens(16, 3), hm.tokens(12, 4)], do_checks=False)
    assert engine.free_blocks == free and engine.seen_tokens(1) == 5
    with pytest.raises(ValueError, match="appears twice"):
        engine.put([2, 2], [hm.tokens(1, 3), hm.tokens(1, 4)])
    with pytest.raises(ValueError, match="at least one token"):
        engine.put([2], [torch.tensor([], dtype=torch.long)])


def test_flush_returns_every_block(llama: Any) -> None:
    engine = make_engine(llama, blocks=32, block=4, prefix_caching=False)
    total = engine.total_blocks
    assert engine.free_blocks == total
    engine.put([1, 2], [hm.tokens(9, 1), hm.tokens(4, 2)])  # 3 + 1 blocks
    engine.put([2], [hm.tokens(1, 3)])  # a fifth token: one block more
    assert engine.free_blocks == total - 5
    engine.flush(1)
    assert engine.free_blocks == total - 2 and not engine.tracked(1) and engine.tracked(2)
    engine.flush(2)
    assert engine.free_blocks == total and engine.n_tracked_sequences == 0
    # a flushed uid starts afresh when put again
    ids = hm.tokens(6, 4)
    hm.assert_close(engine.put([1], [ids])[0], hm.last_logits(llama, ids), atol=ATOL, rtol=0)


def test_flush_errors(llama: Any) -> None:
    engine = small_engine(llama)
    engine.put([1], [hm.tokens(3, 1)])
    engine.flush(1)
    with pytest.raises(ValueError, match="sequence 1: it is not tracked"):
        engine.flush(1)
    with pytest.raises(ValueError, match="sequence 99: it is not tracked"):
        engine.flush(99)


def test_unknown_family_names_the_supported_ones() -> None:
    config = transformers.OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64
    )
    model = transformers.OPTForCausalLM(config)
    with pytest.raises(ValueError, match="model_type='opt'") as info:
        build_hf_engine(model)
    for family in SUPPORTED_FAMILIES:
        assert family in str(info.value)
    with pytest.raises(ValueError, match="supported families"):
        RaggedCausalLM(model)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="offload"):
        RaggedInferenceEngineConfig(state_manager={"offload": True})
    with pytest.raises(ValueError, match="max_context"):
        RaggedInferenceEngineConfig(state_manager={"max_contxt": 4})
    with pytest.raises(ValueError, match="memory_config"):
        make_engine(hm.build("llama"), memory_config={"mode": "reserve", "size": 1 << 60})
    with pytest.raises(ValueError, match="wf6af16"):
        RaggedInferenceEngineConfig(quantization={"quantization_mode": "wf6af16"})
    aliased = RaggedInferenceEngineConfig.from_dict({"tp": {"tp_size": 2}, "manager": {}})
    assert aliased.tensor_parallel.tp_size == 2
    config = RaggedInferenceEngineConfig()
    assert config.state_manager.max_tracked_sequences == 2048
    assert config.state_manager.max_ragged_batch_size == 768
    assert config.state_manager.max_ragged_sequence_count == 512
    assert config.state_manager.max_context == 8192
    assert config.state_manager.kv_block_size == 64 and config.state_manager.prefix_caching


def test_reserve_mode_sizes_the_cache_by_what_can_be_used(llama: Any) -> None:
    state = {"kv_block_size": 4, "max_context": 64, "max_tracked_sequences": 3}
    engine = build_hf_engine(llama, {"state_manager": state | {"memory_config": {"size": 1}}})
    assert engine.total_blocks == 3 * 16  # every tracked sequence at max_context


def test_bf16_model_and_cache() -> None:
    model = hm.build("qwen3")
    ids = hm.tokens(21, 60)
    want = hm.last_logits(model, ids)
    engine = build_hf_engine(
        model,
        {"dtype": "bf16", "state_manager": {"memory_config": {"mode": "allocate", "size": 4}}},
    )
    assert engine.model.dtype == torch.bfloat16
    assert engine._cache.keys[0].dtype == torch.bfloat16
    got = engine.put([1], [ids])[0]
    assert got.dtype == torch.float32
    assert (got.cpu() - want).abs().max() < 0.1 * want.abs().max()


def test_gpt2_context_ends_with_its_position_table() -> None:
    engine = make_engine(hm.build("gpt2", n_positions=32), max_context=256)
    assert engine.max_context == 32
    with pytest.raises(ValueError, match="max_context=32"):
        engine.put([1], [hm.tokens(33, 1)])


def test_put_takes_token_lists_and_tensors_alike() -> None:
    """A run of tokens may be a tensor of any shape or a list of ints (what the scheduler
    passes): the same logits either way."""
    model = hm.build("llama")
    as_tensors, as_lists = make_engine(model), make_engine(model)
    a, b = hm.tokens(9, 1), hm.tokens(4, 2)
    want = as_tensors.put([1, 2], [a, b[None]])
    hm.assert_close(as_lists.put([1, 2], [a.tolist(), b.tolist()]), want, atol=0, rtol=0)
    want = as_tensors.put([1, 2], [torch.tensor(5), torch.tensor([6])])
    hm.assert_close(as_lists.put([1, 2], [[5], [6]]), want, atol=0, rtol=0)
