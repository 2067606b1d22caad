"""gloo's reduce-scatter runs as send/recv + local reduction: same results as gloo's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.comm.gloo_paths import use_send_recv_reduce_scatter
from shardspeed.comm.torch_compat import reduce_scatter_single

OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]


def matches_native(op_name: str, dtype: torch.dtype, async_op: bool, subgroup: bool) -> None:
    op = getattr(comm.ReduceOp, op_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = None
    if subgroup:  # ranks {0, 2} and {1, 3}: every rank must create both groups
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group, world = groups[rank % 2], 2
    assert use_send_recv_reduce_scatter(torch.empty(1), op, group)
    gen = torch.Generator().manual_seed(rank)
    tensor = (torch.rand(world * 5, generator=gen) + 0.5).to(dtype)
    expected = torch.empty(5, dtype=dtype)
    reduce_scatter_single(expected, tensor.clone(), op=op, group=group)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    # a separate output, and in place: the output is this rank's chunk of the input
    separate = torch.empty(5, dtype=dtype)
    in_place = tensor.clone()
    mine = in_place.view(world, -1)[dist.get_rank(group)]
    for got, source in ((separate, tensor), (mine, in_place)):
        work = comm.reduce_scatter_tensor(got, source, op=op, group=group, async_op=async_op)
        if async_op:
            work.wait()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="world size x output"):
        comm.reduce_scatter_tensor(torch.empty(4, dtype=dtype), tensor, op=op, group=group)


@pytest.mark.parametrize("op_name", OPS)
def test_reduce_scatter_fast_path_matches_gloo(dist_pool, op_name):
    pool = dist_pool(2)
    pool.run(matches_native, op_name, torch.float32, False, False)
    pool.run(matches_native, op_name, torch.float32, True, False)


def _group_of_one() -> None:
    group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    tensor = torch.arange(3.0)
    out = torch.empty(3)
    comm.reduce_scatter_tensor(out, tensor, group=group, async_op=True).wait()
    assert torch.equal(out, tensor)
    comm.reduce_scatter_tensor(tensor, tensor, group=group)  # in place: nothing to do
    assert torch.equal(tensor, torch.arange(3.0))


def test_reduce_scatter_fast_path_group_of_one(dist_pool):
    dist_pool(2).run(_group_of_one)


def _awkward_outputs() -> None:
    """Outputs the send/recv path leaves to gloo's own: strided, or overlapping another chunk."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tensor = torch.arange(world * 4.0) * (rank + 1)
    expected = torch.arange(world * 4.0).view(world, 4)[rank] * sum(range(1, world + 1))
    strided = torch.zeros(4, 2)[:, 0]
    comm.reduce_scatter_tensor(strided, tensor.clone(), op=comm.ReduceOp.SUM)
    torch.testing.assert_close(strided, expected)
    source = tensor.clone()
    elsewhere = source.view(world, 4)[(rank + 1) % world]  # another rank's chunk of the input
    comm.reduce_scatter_tensor(elsewhere, source, op=comm.ReduceOp.SUM)
    torch.testing.assert_close(elsewhere, expected)


def test_reduce_scatter_fast_path_leaves_awkward_outputs_to_gloo(dist_pool):
    dist_pool(2).run(_awkward_outputs)


def test_reduce_scatter_fast_path_bf16_and_subgroups(dist_pool):
    dist_pool(2).run(matches_native, "SUM", torch.bfloat16, True, False)
    dist_pool(4).run(matches_native, "SUM", torch.float32, True, True)
    dist_pool(4).run(matches_native, "AVG", torch.float32, False, False)
