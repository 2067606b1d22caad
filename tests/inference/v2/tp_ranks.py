"""Functions run on every rank of a gloo pool by the inference v2 tensor-parallel tests."""

from __future__ import annotations

import copy
from typing import Any

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
