"""A Python pipeline over inference v2, in the shape of DeepSpeed-MII's ``mii.pipeline``.

    pipe = pipeline("path/to/checkpoint")
    responses = pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=64)
    print(responses[0].generated_text)
    pipe.destroy()

All prompts of a call are submitted at once to one ``AsyncGenerationEngine``, so they share
ragged batches (continuous batching) exactly as concurrent server requests do. The text of a
response is its generated tokens decoded with ``skip_special_tokens`` and cut at the first
``stop`` string. Unlike MII, ``do_sample`` defaults to False (greedy), as in Hugging Face
``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardspeed.inference.v2.serving.detokenizer import TextAssembler

__all__ = ["Pipeline", "Response", "pipeline"]

_CONFIG_SECTIONS = ("tensor_parallel", "state_manager", "dtype", "kv_cache_dtype")


@dataclass
class Response:
    """One prompt's result, with MII's field names."""

    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: str

    def __str__(self) -> str:
        return self.generated_text


class Pipeline:
    """Generates text for lists of prompts; built by :func:`pipeline`."""

    def __init__(self, loaded: Any, model_name: str) -> None:
        self._loaded = loaded
        self.model_name = model_name
        self.tokenizer = loaded.tokenizer
        self.engine = loaded.engine

    def __call__(
        self,
        prompts: str | list[str],
        max_new_tokens: int = 128,
        *,
        min_new_tokens: int = 0,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        ignore_eos: bool = False,
        repetition_penalty: float = 1.0,
        stop: str | list[str] | None = None,
        return_full_text: bool = False,
    ) -> list[Response]:
        """Generate for each prompt (a string is one prompt); returns one :class:`Response`
        per prompt, in order."""
        if self._loaded is None:
            raise RuntimeError("this pipeline was destroyed: build a new one with pipeline()")
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(p, str) for p in batch):
            raise TypeError("prompts must be a string or a list of strings")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        params = self._loaded.params_factory(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            ignore_eos=ignore_eos,
            repetition_penalty=repetition_penalty,
        )
        generator = self._loaded.generator
        prompt_ids = [list(self.tokenizer(p)["input_ids"]) for p in batch]
        handles = []
        try:
            for ids in prompt_ids:
                handles.append(generator.submit(ids, params))
            responses = [
                self._collect(h, ids, stops) for h, ids in zip(handles, prompt_ids, strict=True)
            ]
        except BaseException:
            for handle in handles:  # do not leave the rest generating for nobody
                _abort(generator, handle.uid)
            raise
        if return_full_text:
            for response, prompt in zip(responses, batch, strict=True):
                response.generated_text = prompt + response.generated_text
        return responses

    def _collect(self, handle: Any, prompt_ids: list[int], stops: list[str]) -> Response:
        text = TextAssembler(self.tokenizer, stops)
        count = 0
        finish = "none"
        for event in handle.events():
            count += 1
            _, stopped = text.add(int(event.token), bool(event.finished))
            if stopped:
                finish = "stop"
                _abort(self._loaded.generator, handle.uid)
                break
            if event.finished:
                finish = event.finish_reason or "stop"
                break
        return Response(text.text, len(prompt_ids), count, finish)

    def destroy(self) -> None:
        """Stop the generation thread; the pipeline cannot be called afterwards."""
        if self._loaded is not None:
            self._loaded.shutdown()
            self._loaded = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _abort(generator: Any, uid: int) -> None:
    try:
        generator.abort(uid)
    except (KeyError, ValueError):
        pass  # already finished


def pipeline(model_name_or_path: str, tokenizer: str | None = None, **config: Any) -> Pipeline:
    """Load a local checkpoint directory (or a folder ``InferenceEngineV2.serialize`` wrote,
    with ``tokenizer`` naming the folder to take the tokenizer from) into an inference v2
    engine and return a :class:`Pipeline`. ``config`` holds ``RaggedInferenceEngineConfig``
    sections (``tensor_parallel``, ``state_manager``, ``dtype``, ``kv_cache_dtype``) and
    ``max_batch_tokens`` (the scheduler's tokens per step)."""
    from shardspeed.inference.v2.serving.server import load_generator

    max_batch_tokens = config.pop("max_batch_tokens", None)
    unknown = sorted(set(config) - set(_CONFIG_SECTIONS))
    if unknown:
        raise ValueError(
            f"pipeline() got unknown config keys {unknown}: use {list(_CONFIG_SECTIONS)} "
            "or max_batch_tokens"
        )
    loaded = load_generator(
        model_name_or_path,
        engine_config=config,
        max_batch_tokens=max_batch_tokens,
        tokenizer_path=tokenizer,
    )
    return Pipeline(loaded, model_name_or_path)
