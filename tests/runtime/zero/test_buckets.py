"""Staged gradient buckets (stage 2): what each launched bucket holds and where it lives."""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.runtime.zero.buckets import GradBucket, GradientBuckets
from shardspeed.runtime.zero.grad_storage import StagedStorage
from shardspeed.runtime.zero.records import ParamRecord


def test_single_parameter_bucket_adopts_its_gradient() -> None:
    torch.manual_seed(0)
    embed = nn.Parameter(torch.randn(8, 6))  # 48 elements: a bucket of its own
    weight = nn.Parameter(torch.randn(6, 3))  # 18 + 3 elements share one
    bias = nn.Parameter(torch.randn(3))
    launched: dict[int, tuple[torch.Tensor, bool]] = {}

    def launch(bucket: GradBucket) -> None:
        assert bucket.buffer is not None
        # adopted: no storage carved out for the bucket, and exactly the gradient's size
        launched[bucket.index] = (bucket.buffer.clone(), bucket.storage is None)
        buckets.release(bucket)

    records = [ParamRecord(n, p) for n, p in (("bias", bias), ("weight", weight), ("embed", embed))]
    buckets = GradientBuckets(records, 30, launch, pad_to=2, staged=StagedStorage())
    tokens = torch.tensor([0, 3, 3, 7])
    loss = (embed[tokens] @ weight + bias).square().sum()
    expected = torch.autograd.grad(loss, [bias, weight, embed], retain_graph=True)
    buckets.begin(True)
    loss.backward()
    buckets.flush()
    sizes = [b.size for b in buckets.buckets]
    assert sizes == [22, 48]  # bias + weight padded to a multiple of 2; the embedding alone
    small, big = launched[0], launched[1]
    assert big[1] and not small[1]
    torch.testing.assert_close(big[0], expected[2].view(-1), rtol=0, atol=0)
    torch.testing.assert_close(small[0][:3], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(small[0][3:21], expected[1].view(-1), rtol=0, atol=0)
    assert all(p.grad is None for p in (embed, weight, bias))
    # the adopted gradient is not kept for reuse; the carved buffer is, until dropped
    assert buckets.spare_numel() == 22
    buckets.drop_spares()
    assert buckets.spare_numel() == 0
    buckets.remove_hooks()


def test_interleaved_comm_dtypes_fill_one_open_bucket_each() -> None:
    """Linear/LayerNorm parameters alternate comm dtypes under torch_autocast: each dtype fills
    its own bucket (bounded by the size) instead of a bucket being cut at every change, and
    buckets are ordered by when their last parameter arrives."""
    sizes = [4, 2, 4, 2, 4, 2]
    records = [ParamRecord(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    for i, record in enumerate(records):
        record.comm_dtype = torch.bfloat16 if i % 2 == 0 else None
    buckets = GradientBuckets(records, 8, lambda bucket: None)
    layout = [([r for r in records if r.bucket is b], b.comm_dtype) for b in buckets.buckets]
    names = [([r.name for r in rs], dtype) for rs, dtype in layout]
    assert names == [
        (["p0", "p2"], torch.bfloat16),
        (["p4"], torch.bfloat16),
        (["p1", "p3", "p5"], None),
    ]
    assert [r.offset for r in records] == [0, 0, 4, 2, 0, 4]
    buckets.remove_hooks()
