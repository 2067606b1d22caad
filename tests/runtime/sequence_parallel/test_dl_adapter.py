"""UlyssesSPDataLoaderAdapter on 2 gloo ranks: each round serves every rank's batch in turn,
each rank its slice of the sequence, with pre-shifted labels, global positions and DeepSpeed's
padding to a multiple of the sequence-parallel size."""

from __future__ import annotations

import pytest
import torch

from shardspeed.runtime.sequence_parallel import ulysses_sp
from tests.runtime.sequence_parallel import dl_ranks

WORLD = 2


def joined(slices: list[dict], key: str) -> torch.Tensor:
    return torch.cat([s[key] for s in slices], dim=1)


def expected_shift(labels: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(labels, -100)
    out[:, :-1] = labels[:, 1:]
    return out


@pytest.mark.timeout(240)
def test_adapter_serves_slices_of_each_ranks_batch(dist_pool):
    results = dist_pool(WORLD).run(dl_ranks.adapt, epochs=2)
    own = [r["own"] for r in results]
    for result in results:
        assert result["len"] == len(own[0]) * WORLD
        assert len(result["served"][0]) == result["len"]
        assert len(result["served"][1]) == result["len"]  # a second epoch starts afresh
    for epoch in range(2):
        for step in range(results[0]["len"]):
            slices = [r["served"][epoch][step] for r in results]
            # round r serves batch r of rank 0, then batch r of rank 1
            source = own[step % WORLD][step // WORLD]
            for piece in slices:
                assert "labels" not in piece
                assert piece["input_ids"].shape == (2, dl_ranks.SEQ // WORLD)
                assert piece["source"] == source["source"]
                assert torch.equal(piece["row_weight"], source["row_weight"])
                assert piece["input_ids"].device.type == "cpu"
            assert torch.equal(joined(slices, "input_ids"), source["input_ids"])
            assert torch.equal(joined(slices, "shift_labels"), expected_shift(source["labels"]))
            assert torch.equal(
                joined(slices, "position_ids"), torch.arange(dl_ranks.SEQ).expand(2, -1)
            )
            # the label of rank 0's last position is rank 1's first token
            assert torch.equal(slices[0]["shift_labels"][:, -1], slices[1]["input_ids"][:, 0])


@pytest.mark.timeout(240)
def test_adapter_pads_to_a_multiple_of_sp_or_refuses(dist_pool):
    pool = dist_pool(WORLD)
    results = pool.run(dl_ranks.adapt, seq=7)
    source = results[0]["own"][0]
    slices = [r["served"][0][0] for r in results]
    assert slices[0]["input_ids"].shape == (2, 4)
    ids = joined(slices, "input_ids")
    assert torch.equal(ids[:, :7], source["input_ids"]) and bool((ids[:, 7] == 7).all())
    shifted = joined(slices, "shift_labels")
    assert torch.equal(shifted[:, :6], source["labels"][:, 1:])
    assert bool((shifted[:, 6:] == -100).all())
    assert torch.equal(joined(slices, "position_ids"), torch.arange(8).expand(2, -1))
    assert torch.equal(joined(slices, "attention_mask")[:, 7], torch.zeros(2, dtype=torch.long))

    messages = pool.run(dl_ranks.unpadded_refused)
    assert all("seqlen=7 isn't divisible by sp-size=2" in m for m in messages)


@pytest.mark.timeout(240)
def test_adapter_positions_from_document_ids(dist_pool):
    results = dist_pool(WORLD).run(dl_ranks.with_seq_idx)
    slices = [r[0] for r in results]
    assert torch.equal(
        joined(slices, "position_ids"),
        torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]]),
    )
    assert torch.equal(joined(slices, "seq_idx")[0], torch.tensor([0, 0, 0, 1, 1, 1, 1, 2]))


def test_adapter_is_exported_and_refuses_bad_batches():
    adapter_cls = ulysses_sp.UlyssesSPDataLoaderAdapter
    adapter = adapter_cls([{"input_ids": torch.zeros(1, 4, dtype=torch.long)}], 0, None, 1, "cpu")
    with pytest.raises(ValueError, match="must hold a labels tensor"):
        next(adapter)
    with pytest.raises(ValueError, match="sp_rank=2"):
        adapter_cls([], 2, None, 2, "cpu")
    bad = [{"input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 4), "pixel_values": 1}]
    with pytest.raises(ValueError, match="pixel_values"):
        next(adapter_cls(bad, 0, None, 1, "cpu"))
