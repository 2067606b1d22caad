"""``pipeline`` (DeepSpeed-MII's shape) over inference v2: greedy texts equal Hugging Face
``generate`` decoded, prompts batched together, stop strings, the MII response fields."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.inference.v2.pipeline import Pipeline, Response, pipeline
from tests.inference.v2.serve_model import Reference

PROMPTS = ["w1 w2", "w5 w9 w13 w7", "w40", "w3 w3 w3 w3 w3 w3", "w11 w12 w13 w14 w15 w16 w17"]


@pytest.fixture(scope="module")
def pipe(model_dir: Path) -> Iterator[Pipeline]:
    config = {
        "state_manager": {"kv_block_size": 8, "memory_config": {"mode": "allocate", "size": 64}}
    }
    p = pipeline(str(model_dir), max_batch_tokens=16, **config)
    try:
        yield p
    finally:
        p.destroy()


@pytest.mark.timeout(300)
def test_greedy_texts_equal_hf_generate(pipe: Pipeline, reference: Reference) -> None:
    responses = pipe(PROMPTS, max_new_tokens=8)
    assert [type(r) for r in responses] == [Response] * len(PROMPTS)
    for prompt, response in zip(PROMPTS, responses, strict=True):
        ids = reference.prompt_ids(prompt)
        generated = reference.generate_ids(ids, 8)
        assert response.generated_text == reference.text(ids, 8)
        assert str(response) == response.generated_text
        assert response.prompt_length == len(ids)
        assert response.generated_length == len(generated)
        assert response.finish_reason == ("stop" if generated[-1] == 3 else "length")


@pytest.mark.timeout(300)
def test_single_prompt_full_text_and_stop(pipe: Pipeline, reference: Reference) -> None:
    prompt = PROMPTS[2]
    full = reference.text(reference.prompt_ids(prompt), 10)
    [whole] = pipe(prompt, max_new_tokens=10, return_full_text=True)
    assert whole.generated_text == prompt + full
    stop = full.split(" ")[2]
    [cut] = pipe(prompt, max_new_tokens=10, stop=stop)
    assert cut.generated_text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.generated_length < 10


@pytest.mark.timeout(300)
def test_repetition_penalty_equals_hf_generate(pipe: Pipeline, reference: Reference) -> None:
    prompt = "w11 w12 w13"  # greedy repeats w18 a lot
    ids = reference.prompt_ids(prompt)
    expected = reference.generate_ids(ids, 12, repetition_penalty=1.8)
    assert expected != reference.generate_ids(ids, 12)
    [out] = pipe(prompt, max_new_tokens=12, repetition_penalty=1.8)
    assert out.generated_text == reference.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.timeout(300)
def test_bad_arguments(model_dir: Path, pipe: Pipeline) -> None:
    with pytest.raises(ValueError, match="max_batch_token"):
        pipeline(str(model_dir), max_batch_token=8)
    with pytest.raises(TypeError, match="prompts"):
        pipe([1, 2], max_new_tokens=2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_context"):
        pipeline(str(model_dir), state_manager={"max_context": 10_000})


@pytest.mark.timeout(300)
def test_serve_flags_bound_each_steps_sequences(model_dir: Path, reference: Reference) -> None:
    """``shardspeed serve --max-num-seqs 2 --max-batch-tokens 24``: the loaded scheduler takes
    at most 2 sequences and 24 tokens a step, and 5 prompts still give HF's tokens."""
    from shardspeed.inference.v2.serving.cli import build_parser, engine_config_from_args
    from shardspeed.inference.v2.serving.server import load_generator

    args = build_parser().parse_args(
        ["--model", str(model_dir), "--max-num-seqs", "2", "--max-batch-tokens", "24"]
    )
    config = engine_config_from_args(args)
    assert config["state_manager"]["max_ragged_sequence_count"] == 2
    loaded = load_generator(str(model_dir), engine_config=config, max_batch_tokens=24)
    scheduler = loaded.generator.scheduler
    widest: list[int] = []
    step = scheduler.step

    def watched() -> list[Any]:
        events = step()
        widest.append(len(scheduler.last_step))
        assert sum(c.length for c in scheduler.last_step) <= 24
        return events

    scheduler.step = watched
    try:
        prompts = ["w1 w2", "w5 w9 w13 w7", "w40", "w11 w12 w13", "w59 w0 w17"]
        ids = [reference.prompt_ids(p) for p in prompts]
        params = loaded.params_factory(max_new_tokens=6)
        handles = [loaded.generator.submit(i, params) for i in ids]
        for prompt_ids, handle in zip(ids, handles, strict=True):
            tokens = [e.token for e in handle.events()]
            assert tokens == reference.generate_ids(prompt_ids, 6)
    finally:
        loaded.shutdown()
    assert max(widest) == 2  # the bound was reached and held


def test_serve_cuda_graph_flag(model_dir: Path) -> None:
    """``--cuda-graph`` sets enable_cuda_graph; without CUDA loading refuses it by name."""
    from shardspeed.inference.v2.serving.cli import build_parser, engine_config_from_args
    from shardspeed.inference.v2.serving.server import load_generator

    plain = engine_config_from_args(build_parser().parse_args(["--model", str(model_dir)]))
    assert "enable_cuda_graph" not in plain
    args = build_parser().parse_args(["--model", str(model_dir), "--cuda-graph"])
    config = engine_config_from_args(args)
    assert config["enable_cuda_graph"] is True
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs exist only on CUDA devices"):
            load_generator(str(model_dir), engine_config=config)


@pytest.mark.timeout(300)
def test_a_serialized_engine_with_its_tokenizer(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    from shardspeed.inference.v2 import build_hf_engine

    build_hf_engine(str(model_dir)).serialize(tmp_path)
    with pytest.raises(ValueError, match="pass --tokenizer"):
        pipeline(str(tmp_path))
    with pipeline(str(tmp_path), tokenizer=str(model_dir)) as pipe:
        [out] = pipe(PROMPTS[0], max_new_tokens=6)
    assert out.generated_text == reference.text(reference.prompt_ids(PROMPTS[0]), 6)
