"""Loading a model for serving and running the HTTP server (uvicorn) in front of it.

:func:`load_generator` is shared with :func:`shardspeed.inference.v2.pipeline.pipeline`: a
checkpoint directory becomes an ``InferenceEngineV2`` (``build_hf_engine``), its tokenizer, the
end-of-sequence ids Hugging Face ``generate`` stops at, and one ``AsyncGenerationEngine`` whose
background thread runs the continuous-batching scheduler for every request.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from shardspeed.utils.logging import logger

__all__ = [
    "LoadedGenerator",
    "follow_generator",
    "load_generator",
    "model_context_limit",
    "serve",
]

# HF config attributes holding the longest position a model was built for, by family
_POSITION_LIMITS = ("max_position_embeddings", "n_positions")


@dataclass
class LoadedGenerator:
    """A loaded model ready to generate: the engine, its background generation loop, the
    tokenizer and the sampling-parameter class the loop takes."""

    engine: Any
    generator: Any
    tokenizer: Any
    params_factory: Any
    eos_token_ids: list[int]
    max_context: int

    def shutdown(self) -> None:
        """Stop the generation thread (and release the other tensor-parallel ranks)."""
        try:
            self.generator.shutdown()
        finally:
            stop = getattr(self.engine, "stop", None)
            if stop is not None:
                stop()


def model_context_limit(hf_config: Any) -> int | None:
    """The longest sequence ``hf_config``'s positions allow (None when it does not say)."""
    for name in _POSITION_LIMITS:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _eos_ids(path: str, hf_config: Any, tokenizer: Any) -> list[int]:
    """The ids ``generate`` stops at: the generation config's, else the model config's, else
    the tokenizer's end-of-sequence token."""
    from transformers import GenerationConfig

    found: Any = None
    try:
        found = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json
        found = None
    if found is None:
        found = getattr(hf_config, "eos_token_id", None)
    if found is None:
        found = getattr(tokenizer, "eos_token_id", None)
    if found is None:
        return []
    return [int(found)] if isinstance(found, int) else [int(t) for t in found]


def _prepared_config(
    model_path: str, engine_config: dict[str, Any] | None, max_batch_tokens: int | None
) -> tuple[Any, dict[str, Any]]:
    """The model's HF config and the engine config dict to build it with (``max_context``
    defaulted to and checked against the model's positions)."""
    from transformers import AutoConfig

    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory: give a local checkpoint")
    hf_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    config = dict(engine_config or {})
    state = dict(config.get("state_manager") or {})
    limit = model_context_limit(hf_config)
    if limit is not None:
        asked = state.get("max_context")
        if asked is not None and asked > limit:
            raise ValueError(
                f"max_context={asked} exceeds the model's {limit} positions: use at most {limit}"
            )
        state.setdefault("max_context", min(8192, limit))
    if max_batch_tokens is not None:
        state.setdefault("max_ragged_batch_size", max_batch_tokens)
    config["state_manager"] = state
    return hf_config, config


def _tp_size(config: dict[str, Any]) -> int:
    return int((config.get("tensor_parallel") or {}).get("tp_size", 1))


def load_generator(
    model_path: str,
    *,
    engine_config: dict[str, Any] | None = None,
    max_batch_tokens: int | None = None,
    tokenizer_path: str | None = None,
) -> LoadedGenerator:
    """Build the engine over the checkpoint at ``model_path`` (a Hugging Face folder, or one
    ``InferenceEngineV2.serialize`` wrote) and start its generation loop; the tokenizer comes
    from ``tokenizer_path`` (default: ``model_path``; a serialized folder holds none).
    ``engine_config`` is a ``RaggedInferenceEngineConfig`` dict; its ``state_manager.max_context``
    defaults to the model's own position limit (at most 8192) and may not exceed it. With
    ``tensor_parallel.tp_size`` > 1 this is rank 0's part: its engine calls reach the other
    ranks, which run :func:`follow_generator` with the same arguments."""
    from transformers import AutoTokenizer

    from shardspeed.inference.v2 import RaggedInferenceEngineConfig, build_hf_engine
    from shardspeed.inference.v2.scheduler import AsyncGenerationEngine, SamplingParams
    from shardspeed.inference.v2.serving.lockstep import LockstepEngine

    hf_config, config = _prepared_config(model_path, engine_config, max_batch_tokens)
    source = tokenizer_path or model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a tokenizer from {source!r} ({type(exc).__name__}); a folder written "
            "by serialize() holds none: pass --tokenizer with the model's Hugging Face folder"
        ) from exc
    engine: Any = build_hf_engine(model_path, RaggedInferenceEngineConfig.from_dict(config))
    if _tp_size(config) > 1:
        engine = LockstepEngine(engine)
    eos = _eos_ids(model_path, hf_config, tokenizer)
    generator = AsyncGenerationEngine(engine, token_budget=max_batch_tokens, eos_token_ids=eos)
    return LoadedGenerator(
        engine=engine,
        generator=generator,
        tokenizer=tokenizer,
        params_factory=SamplingParams,
        eos_token_ids=eos,
        max_context=int(engine.max_context),
    )


def follow_generator(
    model_path: str,
    *,
    engine_config: dict[str, Any] | None = None,
    max_batch_tokens: int | None = None,
) -> int:
    """A tensor-parallel rank other than 0: build its shard of the engine (the arguments of
    rank 0's :func:`load_generator`) and make rank 0's engine calls until it stops; returns
    how many it made."""
    from shardspeed.inference.v2 import RaggedInferenceEngineConfig, build_hf_engine
    from shardspeed.inference.v2.serving.lockstep import follow

    _, config = _prepared_config(model_path, engine_config, max_batch_tokens)
    engine = build_hf_engine(model_path, RaggedInferenceEngineConfig.from_dict(config))
    return follow(engine)


def serve(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    engine_config: dict[str, Any] | None = None,
    max_batch_tokens: int | None = None,
    log_level: str = "info",
    api_key: str | None = None,
    tokenizer_path: str | None = None,
) -> None:
    """Load ``model_path`` (its tokenizer from ``tokenizer_path`` when given) and serve it over
    HTTP until SIGINT/SIGTERM. ``port`` 0 takes a free port; the line ``shardspeed serve:
    listening on http://HOST:PORT`` names it. With ``api_key`` every route but ``/health`` and
    ``/metrics`` answers only requests bearing it. With
    ``tensor_parallel.tp_size`` > 1 (every rank of a launched job calls this) rank 0 serves
    and the other ranks follow its engine calls."""
    import uvicorn

    from shardspeed import comm
    from shardspeed.inference.v2.serving.app import build_app
    from shardspeed.inference.v2.serving.generation import ServingContext

    tp = _tp_size(engine_config or {})
    if tp > 1:
        comm.init_distributed()
        if comm.get_world_size() != tp:
            raise ValueError(
                f"--tp {tp} needs a job of {tp} ranks, this one has {comm.get_world_size()}: run "
                f"`shardspeed serve --tp {tp} ...` (it launches the ranks itself)"
            )
        if comm.get_rank() != 0:
            follow_generator(
                model_path, engine_config=engine_config, max_batch_tokens=max_batch_tokens
            )
            return

    # bind before loading so a taken port fails fast, and so port 0 is known up front
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc}; pick another --port") from exc
    try:
        loaded = load_generator(
            model_path,
            engine_config=engine_config,
            max_batch_tokens=max_batch_tokens,
            tokenizer_path=tokenizer_path,
        )
    except BaseException:
        sock.close()
        raise
    name = served_model_name or model_path
    context = ServingContext(
        backend=loaded.generator,
        tokenizer=loaded.tokenizer,
        model_name=name,
        max_context=loaded.max_context,
        params_factory=loaded.params_factory,
        aliases=frozenset({model_path, os.path.abspath(model_path)}),
        api_key=api_key,
    )
    config = uvicorn.Config(
        build_app(context),
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    bound = sock.getsockname()
    print(
        f"shardspeed serve: listening on http://{bound[0]}:{bound[1]} (model {name!r})",
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        loaded.shutdown()
        sock.close()
        logger.info("shardspeed serve: stopped")
