"""Rank-side code of the ZeRO++ tests (sent to a pool of gloo ranks): a small GPT trained
under ZeRO-3 with the ZeRO++ keys a test names, on 4 ranks seen as 2 nodes of 2."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import shardspeed
from examples.gpt_model import GPT, GPTConfig
from shardspeed import comm
from tests.inference.models import VOCAB, structured_stream

SMALL_GPT = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32)


@contextmanager
def node_size(ranks: int) -> Iterator[None]:
    """Make the launcher's ``LOCAL_WORLD_SIZE`` say ``ranks`` ranks per node inside the block."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def config(zeropp: dict[str, Any], micro: int = 2, **extra: Any) -> dict[str, Any]:
    """A ZeRO-3 config with every unit gathered and released (no persistent parameters)."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "eps": 1e-6}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            **zeropp,
        },
        **extra,
    }


def batch(step: int, micro: int) -> torch.Tensor:
    """This rank's share of global batch ``step`` of the structured stream."""
    tokens = structured_stream(micro * comm.get_world_size(), 17, seed=1000 + step)
    rank = comm.get_rank()
    return tokens[rank * micro : (rank + 1) * micro]


def train(
    zeropp: dict[str, Any],
    steps: int,
    micro: int = 2,
    seed: int = 0,
    save: tuple[str, int] | None = None,
    load: str | None = None,
    start: int = 0,
    node: int = 2,
    extra: dict[str, Any] | None = None,
    volumes: bool = False,
) -> dict[str, Any]:
    """Train the small GPT ``steps`` steps from ``start`` under ZeRO-3 with ``zeropp``; per step
    the loss (and, with ``volumes``, the bytes each collective moved by group size); the final
    parameters, gathered. ``save=(dir, after)`` checkpoints after that many steps; ``load``
    resumes."""
    torch.manual_seed(seed)
    with node_size(node):
        engine, *_ = shardspeed.initialize(
            model=GPT(SMALL_GPT), config=config(zeropp, micro, **(extra or {}))
        )
    if load is not None:
        engine.load_checkpoint(load)
    record: dict[str, Any] = {"loss": [], "volume": []}
    for step in range(start, start + steps):
        tokens = batch(step, micro)
        comm.reset_comm_volume()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        if volumes:
            record["volume"].append(comm.get_comm_volume(by_group_size=True))
        record["loss"].append(loss.item())
        if save is not None and step + 1 == save[1]:
            engine.save_checkpoint(save[0], tag="zeropp")
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        record["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return record


def traffic_case(zeropp: dict[str, Any], node: int = 2) -> dict[str, Any]:
    """The ZeRO++ log line (rank 0) and one step's measured bus bytes per rank, in all and over
    groups spanning nodes (the second step: the first records the module order)."""
    import logging

    from shardspeed.utils.logging import logger

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logger.addHandler(handler)
    try:
        torch.manual_seed(0)
        with node_size(node):
            engine, *_ = shardspeed.initialize(model=GPT(SMALL_GPT), config=config(zeropp))
            out: dict[str, Any] = {}
            for step in range(2):
                tokens = batch(step, 2)
                comm.reset_comm_volume()
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                total = comm.get_comm_volume()
                crossing = comm.get_comm_volume(crossing_nodes=True)
            out["total"] = sum(v["bus_bytes"] for v in total.values())
            out["crossing"] = sum(v["bus_bytes"] for v in crossing.values())
        engine.destroy()
    finally:
        logger.removeHandler(handler)
    out["lines"] = [line for line in lines if "ZeRO++ (" in line]
    return out
