"""Functions run on every rank of a gloo pool by the inference v2 tensor-parallel tests."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from shardspeed import comm
from shardspeed.inference.v2 import build_hf_engine
from tests.inference.v2 import hf_models as hm


def tp_parity(families: list[str]) -> dict[str, dict[str, Any]]:
    """Each family at tp = world vs tp 1 on the same ragged batches (new prompts, a prompt in
    two chunks, decode tokens): max logit difference, whether greedy tokens agree, and this
    rank's cache kv heads against the model's."""
    world = comm.get_world_size()
    results: dict[str, dict[str, Any]] = {}
    for family in families:
        model = hm.build(family)
        state = {"kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 48}}
        engines = [
            build_hf_engine(copy.deepcopy(model), {"state_manager": state}),
            build_hf_engine(
                copy.deepcopy(model),
                {"state_manager": state, "tensor_parallel": {"tp_size": world}},
            ),
        ]
        long = hm.tokens(30, 1)
        steps = [
            {1: hm.tokens(9, 2), 2: long[:13]},
            {2: long[13:], 3: hm.tokens(5, 3), 1: hm.tokens(1, 4)},
        ]
        max_err = 0.0
        tokens: list[list[int]] = [[], []]
        for i, engine in enumerate(engines):
            outs = [engine.put(list(s), list(s.values())) for s in steps]
            logits = outs[-1]
            for _ in range(8):
                nxt = logits.argmax(-1)
                tokens[i] += nxt.tolist()
                logits = engine.put(list(steps[-1]), [t.view(1) for t in nxt])
                outs.append(logits)
            if i == 0:
                reference = outs
            else:
                max_err = max(
                    (a - b).abs().max().item() for a, b in zip(outs, reference, strict=True)
                )
        config = model.config
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        results[family] = {
            "max_err": max_err,
            "tokens_equal": tokens[0] == tokens[1],
            "cache_kv_heads": engines[1].model.kv_heads,
            "model_kv_heads": kv,
        }
    return results


def lockstep_serving(heartbeat_s: float) -> dict[str, Any]:
    """Rank 0 drives a tp = world engine through a ``LockstepEngine`` (puts, a flush, an idle
    spell long enough for heartbeats, a put that fails its checks, a prefix-cache clear) while
    the other ranks ``follow``; every rank reports its engine's state afterwards."""
    import time

    import torch

    from shardspeed.inference.v2.serving.lockstep import LockstepEngine, follow

    world = comm.get_world_size()
    state = {"kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 48}}
    config = {"state_manager": state, "tensor_parallel": {"tp_size": world}}
    engine = build_hf_engine(hm.build("llama"), config)
    out: dict[str, Any] = {}
    if comm.get_rank() == 0:
        lock = LockstepEngine(engine, heartbeat_s=heartbeat_s)
        logits = lock.put([1, 2], [hm.tokens(9, 2), hm.tokens(6, 3)])
        tokens = []
        for _ in range(4):
            nxt = logits.argmax(-1)
            tokens.append(nxt.tolist())
            logits = lock.put([1, 2], [t.view(1) for t in nxt])
        lock.flush(2)
        time.sleep(6 * heartbeat_s)  # idle: the followers get no-ops, not a stuck collective
        try:
            lock.put([3], [hm.tokens(300, 4)])  # more than the cache: refused on every rank
        except ValueError as exc:
            out["refused"] = str(exc)
        lock.put([1], [torch.tensor([7])])
        out["cleared"] = lock.clear_prefix_cache()
        out["tokens"] = tokens
        out["heartbeats"] = lock.heartbeats
        out["reads"] = lock.free_blocks == engine.free_blocks
        try:  # the state manager would change this rank's engine alone
            lock._state.flush_sequence(1)
        except AttributeError as exc:
            out["blocked"] = str(exc)
        lock.stop()
        lock.stop()  # twice is harmless
    else:
        out["calls"] = follow(engine)
    out["free_blocks"] = engine.free_blocks
    out["tracked"] = [engine.tracked(u) for u in (1, 2)]
    out["seen"] = engine.seen_tokens(1)
    return out


def serialize_round_trip(folder: str, families: list[str]) -> dict[str, dict[str, Any]]:
    """Each family at tp = world: logits of a few ragged batches, ``serialize`` on every rank,
    then ``build_engine_from_ds_checkpoint`` at the same tp: the same batches' logits, whether
    they are bitwise equal, the folder's files, and the error of loading it at tp 1."""
    from shardspeed.inference.v2 import build_engine_from_ds_checkpoint

    world = comm.get_world_size()
    config = {
        "state_manager": {"kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 48}},
        "tensor_parallel": {"tp_size": world},
    }
    results: dict[str, dict[str, Any]] = {}
    for name in families:
        family, _, dtype = name.partition(":")  # "llama:bfloat16": that family in that dtype
        where = f"{folder}/{name}"
        steps = [
            {1: hm.tokens(9, 2), 2: hm.tokens(13, 1)},
            {2: hm.tokens(4, 5), 3: hm.tokens(5, 3), 1: hm.tokens(1, 4)},
        ]
        model = hm.build(family)
        engine = build_hf_engine(model.to(getattr(torch, dtype or "float32")), config)
        before = [engine.put(list(s), list(s.values())) for s in steps]
        engine.serialize(where)
        comm.barrier()  # rank 0's config is written before any rank loads
        loaded = build_engine_from_ds_checkpoint(where, config)
        after = [loaded.put(list(s), list(s.values())) for s in steps]
        try:
            build_engine_from_ds_checkpoint(where, {"state_manager": config["state_manager"]})
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        results[name] = {
            "equal": all(a.equal(b) for a, b in zip(before, after, strict=True)),
            "dtype": str(loaded.model.dtype),
            "files": sorted(os.listdir(where)),
            "refused": refused,
            "kv_heads": loaded.model.kv_heads,
        }
        comm.barrier()
    return results
