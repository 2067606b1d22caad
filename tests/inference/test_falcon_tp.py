"""AutoTP on Falcon's fused ``query_key_value`` in its three layouts (multi-query, head by head,
per key/value group), on real gloo ranks: logits and 32 greedy tokens equal the single-process
Hugging Face model, each rank holds ~1/tp of the weights, a safetensors checkpoint loads into
an empty model slice by slice; alibi Falcon is refused by name."""

from __future__ import annotations

import pytest

from shardspeed.inference.tp_plan import build_plan
from tests.inference import models, ranks


@pytest.mark.parametrize(
    ("world", "families"),
    [(2, ["falcon", "falcon-mha", "falcon-gqa"]), (4, ["falcon", "falcon-gqa"])],
    ids=["tp2", "tp4"],  # tp 4 on falcon-gqa: 2 key/value heads, each shared by 2 ranks
)
def test_falcon_tp_matches_single_process(dist_pool, world, families):
    results = dist_pool(world).run(ranks.tp_parity, families)
    # norms stay replicated, and key/value heads where there are fewer than ranks
    # (multi-query's one, falcon-gqa's two at tp 4): a little over 1/tp, as in test_autotp
    ranks.check_tp_parity(results, families, slack={})


def test_falcon_alibi_is_refused_by_name():
    with pytest.raises(ValueError, match="alibi=True"):
        build_plan(models.build("falcon", alibi=True), tp_size=2, rank=0)


@pytest.mark.parametrize("family", ["falcon", "falcon-mha", "falcon-gqa"])
def test_falcon_plan_splits_query_key_value_and_mlp(family):
    plan = build_plan(models.build(family), tp_size=2, rank=1)
    qkv = plan.linears["transformer.h.0.self_attention.query_key_value"]
    rows = {"falcon": 4 * 8 + 2 * 8, "falcon-mha": 4 * 3 * 8, "falcon-gqa": (4 + 2) * 8}
    assert qkv.kind == "column" and qkv.piece.size == rows[family]
    assert plan.linears["transformer.h.0.self_attention.dense"].kind == "row"
    assert plan.linears["transformer.h.0.mlp.dense_4h_to_h"].piece.size == 128


def test_falcon_loads_from_safetensors_slice_by_slice(dist_pool, tmp_path):
    # multi-query's fused rows are read as three pieces (q heads, k, v) per rank
    results = dist_pool(2).run(ranks.load_from_safetensors, "falcon", str(tmp_path / "ckpt"))
    for figures in results:
        assert figures["shards"] > 1
        assert figures["on_meta"] == []
        assert figures["max_err"] < 1e-5, figures
