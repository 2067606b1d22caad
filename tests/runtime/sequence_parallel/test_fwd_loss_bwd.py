"""UlyssesSPFwdLossBwdWithLogits on 2 gloo ranks: the loss is the mean of the group's batches'
losses, and the ranks' gradients add up to sp times those of the whole sequences (the engine's
mean over the sequence-parallel ranks makes them exact)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.runtime.sequence_parallel import fwd_ranks

WORLD = 2


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = fwd_ranks.ToyLM()
    losses = []
    for rank in range(WORLD):
        batch = fwd_ranks.rank_batch(rank)
        labels = batch.pop("labels")
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        logits = model(**batch).logits
        loss = model.loss_function(logits, None, fwd_ranks.VOCAB, shift_labels=shifted)
        loss.backward()
        losses.append(loss.item())
    return sum(losses) / WORLD, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shards", [1, 3])
def test_fwd_loss_bwd_equals_whole_sequences(dist_pool, shards: int):
    results = dist_pool(WORLD).run(fwd_ranks.fwd_loss_bwd, shards)
    want_loss, want_grads = reference()
    for result in results:
        assert abs(result["loss"] - want_loss) < 1e-5 * abs(want_loss)
    for name, want in want_grads.items():
        got = sum(r["grads"][name] for r in results) / WORLD
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        # each rank holds only part of it (its slice of each batch)
        assert not torch.allclose(results[0]["grads"][name], want, rtol=1e-3)
