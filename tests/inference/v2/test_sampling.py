"""Per-request sampling against Hugging Face's own logits processors."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardspeed.inference.v2.scheduler.sampling import (
    SamplingParams,
    adjust_logits,
    make_generator,
    sample,
    warp_logits,
)


def _hf_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF's warpers in generate's order (temperature, top-k, top-p) on a (batch, vocab) tensor."""
    procs = LogitsProcessorList()
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return procs(ids, logits.clone())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.8},
        {"top_k": 20},
        {"top_k": 1},
        {"top_p": 0.9},
        {"top_p": 0.05},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 20},
        {"temperature": 1.7, "top_p": 0.5, "top_k": 200},
    ],
)
def test_warp_equals_hf_warpers(kwargs: dict[str, float]) -> None:
    torch.manual_seed(0)
    params = SamplingParams(do_sample=True, **kwargs)
    logits = torch.randn(64, 300) * 3
    ours = warp_logits(logits, params)
    theirs = _hf_warp(logits, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    keep = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[keep], theirs[keep])
    if kwargs.get("top_k") == 1 or kwargs.get("top_p") == 0.05:
        # Only the top token can survive these; the mask must not be vacuous.
        assert int(keep.sum()) < 2 * logits.shape[0]


def test_top_k_keeps_ties_like_hf() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    params = SamplingParams(do_sample=True, top_k=2)
    ours = warp_logits(logits, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(_hf_warp(logits, params)))
    assert torch.isinf(ours).tolist() == [[True, False, False, True, False]]


def test_sample_draw_equals_multinomial_over_hf_warped() -> None:
    torch.manual_seed(1)
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, top_k=20, seed=1234)
    g_ours, g_ref = make_generator(params), make_generator(params)
    for _ in range(50):
        logits = torch.randn(500)
        ref_probs = _hf_warp(logits[None], params).softmax(-1)
        expected = int(torch.multinomial(ref_probs, 1, generator=g_ref))
        assert sample(logits, params, g_ours) == expected


def test_seeded_draws_repeat_and_differ_across_seeds() -> None:
    logits = torch.zeros(1000)
    draws = {}
    for seed in (1, 1, 2):
        params = SamplingParams(do_sample=True, seed=seed)
        g = make_generator(params)
        draws.setdefault(seed, []).append([sample(logits, params, g) for _ in range(20)])
    assert draws[1][0] == draws[1][1]
    assert draws[1][0] != draws[2][0]


def test_greedy_is_first_argmax() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 5.0])
    assert sample(logits, SamplingParams()) == 1
    assert sample(logits, SamplingParams(), suppress=[1]) == 3


def test_suppress_equals_hf_min_new_tokens() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, 50)
    logits[0, 7] = 100.0
    hf = MinNewTokensLengthLogitsProcessor(
        prompt_length_to_skip=1, min_new_tokens=3, eos_token_id=[7, 9]
    )
    hf_scores = hf(torch.zeros(1, 2, dtype=torch.long), logits.clone())
    assert sample(logits[0], SamplingParams(), suppress=[7, 9]) == int(hf_scores.argmax())
    assert sample(logits[0], SamplingParams()) == 7


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2, "min_new_tokens": 3}, "min_new_tokens"),
        ({"top_q": 0.5}, "top_q"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        SamplingParams(**kwargs)


def test_sample_refuses_batched_logits() -> None:
    with pytest.raises(ValueError, match="one request"):
        sample(torch.zeros(2, 5), SamplingParams())


def test_bias_and_repetition_penalty_equal_hf_processors() -> None:
    """Hugging Face's order (sequence bias, then repetition penalty over prompt + generated)
    on logits of both signs, with repeated tokens in the history."""
    torch.manual_seed(3)
    logits = torch.randn(80) * 4
    prompt, generated = [5, 9, 9, 40, 2], [11, 5, 63, 11]
    bias = {5: 3.5, 11: -2.0, 70: 1.25}
    params = SamplingParams(logit_bias=bias, repetition_penalty=1.7)
    given = logits.clone()
    ours = adjust_logits(logits, params, torch.tensor(prompt), generated)
    hf = LogitsProcessorList(
        [
            SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
            RepetitionPenaltyLogitsProcessor(1.7),
        ]
    )
    theirs = hf(torch.tensor([prompt + generated]), logits[None].clone())[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(ours, logits)  # the adjustment is not vacuous
    assert torch.equal(logits, given)  # and the input is left as it was


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    """OpenAI's definition, written out token by token: logit - count * frequency -
    (count > 0) * presence, counting generated tokens, never the prompt's."""
    torch.manual_seed(4)
    logits = torch.randn(50)
    prompt, generated = [7, 7, 8], [3, 3, 3, 9, 7]
    params = SamplingParams(frequency_penalty=0.6, presence_penalty=-1.1)
    ours = adjust_logits(logits, params, torch.tensor(prompt), generated)
    expected = logits.clone()
    for token in range(50):
        count = generated.count(token)
        expected[token] -= 0.6 * count + (-1.1 if count else 0.0)
    torch.testing.assert_close(ours, expected)
    assert ours[8] == logits[8]  # a prompt-only token is not penalised
    # nothing generated yet: nothing to penalise
    torch.testing.assert_close(adjust_logits(logits, params, torch.tensor(prompt), []), logits)


def test_adjust_refuses_a_bias_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocabulary has 50"):
        adjust_logits(torch.zeros(50), SamplingParams(logit_bias={50: 1.0}), torch.tensor([1]), [])
