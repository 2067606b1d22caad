"""``shardspeed serve``: the command line of the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

__all__ = ["build_parser", "engine_config_from_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``shardspeed serve``."""
    p = argparse.ArgumentParser(
        prog="shardspeed serve",
        description="Serve a Hugging Face causal LM checkpoint with an OpenAI-compatible HTTP "
        "API (/v1/completions, /v1/chat/completions, /v1/models, /health) on inference v2's "
        "continuous batching.",
    )
    p.add_argument("--model", required=True, help="local checkpoint directory (from_pretrained)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="folder of the tokenizer (default: --model; needed when --model is a folder "
        "InferenceEngineV2.serialize wrote, which holds no tokenizer)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 takes a free one")
    p.add_argument(
        "--served-model-name", default=None, help="name clients pass as `model` (default: --model)"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: the model split by AutoTP over this many ranks (GPUs, or "
        "CPU processes), launched by this command; rank 0 serves HTTP",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="tokens per scheduler step (state_manager.max_ragged_batch_size; default 768)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences per scheduler step (state_manager.max_ragged_sequence_count; "
        "default 512): fewer bound each step's time, so the inter-token latency, at some "
        "throughput",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="longest prompt + completion in tokens (default: the model's positions, <= 8192)",
    )
    p.add_argument("--kv-block-size", type=int, default=None, help="tokens per KV-cache block")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV-cache blocks to allocate (memory_config mode 'allocate'; default: reserve mode)",
    )
    p.add_argument("--dtype", default=None, help="model dtype, e.g. float32, bfloat16")
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="do not share prompt-prefix KV blocks"
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="decode batches and fresh prompts replayed from CUDA graphs, one per padded shape, "
        "each captured the first time it is needed (enable_cuda_graph; CUDA and --tp 1 only)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("SHARDSPEED_API_KEY"),
        help="require this key on /v1 requests ('Authorization: Bearer KEY', the OpenAI "
        "client's api_key); default: $SHARDSPEED_API_KEY (which keeps it out of the process "
        "list), else no key",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    return p


def engine_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RaggedInferenceEngineConfig`` dict the flags describe."""
    if args.tp < 1:
        raise ValueError(f"--tp {args.tp}: the tensor-parallel degree must be >= 1")
    state: dict[str, Any] = {}
    if args.max_context is not None:
        state["max_context"] = args.max_context
    if args.max_batch_tokens is not None:
        state["max_ragged_batch_size"] = args.max_batch_tokens
    if args.max_num_seqs is not None:
        state["max_ragged_sequence_count"] = args.max_num_seqs
    if args.kv_block_size is not None:
        state["kv_block_size"] = args.kv_block_size
    if args.kv_blocks is not None:
        state["memory_config"] = {"mode": "allocate", "size": args.kv_blocks}
    if args.no_prefix_caching:
        state["prefix_caching"] = False
    config: dict[str, Any] = {"tensor_parallel": {"tp_size": args.tp}, "state_manager": state}
    if args.dtype is not None:
        config["dtype"] = args.dtype
    if args.cuda_graph:
        config["enable_cuda_graph"] = True
    return config


def _launch_ranks(tp: int, argv: list[str]) -> int:
    """Run this command on ``tp`` ranks of one local job (shardspeed's launcher: all ranks
    torn down when one fails, signals forwarded) and return the job's exit code."""
    from shardspeed.launcher.runner import main as launch

    with socket.socket() as probe:  # a free rendezvous port: two servers may run side by side
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return launch(
        [
            "--num_gpus",
            str(tp),
            "--master_port",
            str(port),
            "--no_local_rank",
            "--module",
            __name__,
            *argv,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and serve until interrupted; returns the exit code. ``--tp`` > 1 outside
    a launched job launches its ranks, each running this again."""
    from shardspeed.inference.v2.serving.server import serve

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.api_key is not None and not args.api_key.strip():
        # an empty secret (a missing variable, say) must not quietly serve with no key
        raise ValueError(
            "the API key is empty (--api-key or SHARDSPEED_API_KEY): give the key, or unset "
            "SHARDSPEED_API_KEY and drop --api-key to serve without one"
        )
    engine_config = engine_config_from_args(args)
    # a rank of a job of tp ranks serves (or follows); anything else launches that job (a
    # WORLD_SIZE left in the environment by some other job does not count)
    in_job = os.environ.get("WORLD_SIZE") == str(args.tp) and "RANK" in os.environ
    if args.tp > 1 and not in_job:
        return _launch_ranks(args.tp, argv)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        engine_config=engine_config,
        max_batch_tokens=args.max_batch_tokens,
        log_level=args.log_level,
        api_key=args.api_key,
        tokenizer_path=args.tokenizer,
    )
    return 0


if __name__ == "__main__":  # each rank of a --tp job
    sys.exit(main())
