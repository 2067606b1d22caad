"""Every shardspeed.comm collective against torch.distributed on live gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed import comm


def _rank_tensor(n: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rank = dist.get_rank()
    return torch.arange(n, dtype=dtype) + 10 * rank


def _check_reductions() -> bool:
    for op in (comm.ReduceOp.SUM, comm.ReduceOp.MAX, comm.ReduceOp.MIN, comm.ReduceOp.PRODUCT):
        mine, ref = _rank_tensor(), _rank_tensor()
        comm.all_reduce(mine, op=op)
        dist.all_reduce(ref, op=op)
        assert torch.equal(mine, ref), op
        comm.inference_all_reduce(mine, op=op)
        dist.all_reduce(ref, op=op)
        assert torch.equal(mine, ref), op
    mine, ref = _rank_tensor(), _rank_tensor()
    comm.reduce(mine, dst=1)
    dist.reduce(ref, dst=1)
    if dist.get_rank() == 1:
        assert torch.equal(mine, ref)
    mine, ref = _rank_tensor(), _rank_tensor()
    comm.broadcast(mine, src=1)
    dist.broadcast(ref, src=1)
    assert torch.equal(mine, ref) and torch.equal(mine, torch.arange(6.0) + 10)
    return True


def _check_gathers() -> bool:
    world = dist.get_world_size()
    x = _rank_tensor(4)
    expected = torch.cat([torch.arange(4.0) + 10 * r for r in range(world)])
    out_list = [torch.empty(4) for _ in range(world)]
    comm.all_gather(out_list, x)
    assert torch.equal(torch.cat(out_list), expected)
    out = torch.empty(4 * world)
    comm.all_gather_into_tensor(out, x)
    assert torch.equal(out, expected)
    out2 = torch.empty(4 * world)
    comm.allgather_fn(out2, x)
    assert torch.equal(out2, expected)
    # in place: the input is this rank's row of the output (what ZeRO's flat parameters do)
    flat = torch.full((4 * world,), -1.0)
    row = flat.view(world, 4)[dist.get_rank()]
    row.copy_(x)
    comm.all_gather_into_tensor(flat, row, async_op=True).wait()
    assert torch.equal(flat, expected)
    # a subgroup of the odd ranks: the roots are group ranks mapped to global ones
    odd = [r for r in range(world) if r % 2 == 1]
    sub = comm.new_group(odd)
    if dist.get_rank() in odd:
        out3 = torch.empty(4 * len(odd))
        comm.all_gather_into_tensor(out3, x, group=sub)
        assert torch.equal(out3, torch.cat([torch.arange(4.0) + 10 * r for r in odd]))
    try:
        comm.all_gather_into_tensor(torch.empty(4 * world + 1), x)
    except (ValueError, RuntimeError) as error:
        assert "elements" in str(error) or "size" in str(error).lower()
    else:
        raise AssertionError("a wrongly sized output must be refused")
    objects: list[object] = [None] * world
    comm.all_gather_object(objects, {"rank": dist.get_rank()})
    assert objects == [{"rank": r} for r in range(world)]
    payload: list[object] = [f"from {dist.get_rank()}", None]
    comm.broadcast_object_list(payload, src=0)
    assert payload == ["from 0", None]
    return True


def _check_reduce_scatters() -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.arange(3.0 * world) * (rank + 1)
    expected = (torch.arange(3.0 * world) * sum(r + 1 for r in range(world))).chunk(world)[rank]
    out = torch.empty(3)
    comm.reduce_scatter_tensor(out, full.clone())
    assert torch.equal(out, expected)
    out = torch.empty(3)
    comm.reduce_scatter_fn(out, full.clone())
    assert torch.equal(out, expected)
    out = torch.empty(3)
    comm.reduce_scatter(out, list(full.clone().chunk(world)))
    assert torch.equal(out, expected)
    return True


def _check_all_to_all() -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    # rank r sends (r + 1) elements to every peer, each tagged with sender and receiver
    splits_in = [rank + 1] * world
    splits_out = [r + 1 for r in range(world)]
    inp = torch.cat([torch.full((rank + 1,), 100.0 * rank + dst) for dst in range(world)])
    mine = torch.empty(sum(splits_out))
    ref = torch.empty(sum(splits_out))
    comm.all_to_all_single(mine, inp, splits_out, splits_in)
    dist.all_to_all_single(ref, inp, splits_out, splits_in)
    assert torch.equal(mine, ref)
    assert torch.equal(
        mine, torch.cat([torch.full((r + 1,), 100.0 * r + rank) for r in range(world)])
    )
    inputs = [torch.full((2, 2), 10.0 * rank + dst) for dst in range(world)]
    outputs = [torch.empty(2, 2) for _ in range(world)]
    comm.all_to_all(outputs, inputs)
    for src, t in enumerate(outputs):
        assert torch.equal(t, torch.full((2, 2), 10.0 * src + rank))
    return True


def _check_gather_scatter() -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    x = _rank_tensor(3)
    gathered = [torch.empty(3) for _ in range(world)] if rank == 0 else None
    comm.gather(x, gathered, dst=0)
    if rank == 0:
        assert torch.equal(
            torch.stack(gathered), torch.stack([torch.arange(3.0) + 10 * r for r in range(world)])
        )
    got = torch.empty(2)
    pieces = [torch.full((2,), float(r)) for r in range(world)] if rank == 1 else None
    comm.scatter(got, pieces, src=1)
    assert torch.equal(got, torch.full((2,), float(rank)))
    return True


def _check_p2p() -> int:
    rank = dist.get_rank()
    t = torch.full((5,), float(rank))
    if rank == 0:
        comm.send(t, dst=1)
        back = torch.empty(5)
        comm.irecv(back, src=1).wait()
        assert torch.equal(back, torch.full((5,), 1.0))
    elif rank == 1:
        got = torch.empty(5)
        sender = comm.recv(got, src=0)
        assert sender == 0 and torch.equal(got, torch.zeros(5))
        comm.isend(t, dst=0).wait()
    comm.barrier()
    comm.monitored_barrier()
    return rank


def _check_async_handles() -> bool:
    world = dist.get_world_size()
    t = _rank_tensor()
    work = comm.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    assert torch.equal(t, sum(torch.arange(6.0) + 10 * r for r in range(world)))
    out = torch.empty(6 * world)
    comm.all_gather_into_tensor(out, _rank_tensor(), async_op=True).wait()
    assert torch.equal(out, torch.cat([torch.arange(6.0) + 10 * r for r in range(world)]))
    rs = torch.empty(2)
    comm.reduce_scatter_tensor(rs, torch.ones(2 * world), async_op=True).wait()
    assert torch.equal(rs, torch.full((2,), float(world)))
    outputs = [torch.empty(1) for _ in range(world)]
    comm.all_to_all(outputs, [torch.ones(1) * dist.get_rank()] * world, async_op=True).wait()
    assert [o.item() for o in outputs] == [float(r) for r in range(world)]
    comm.barrier(async_op=True).wait()
    return True


def _check_coalesced() -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    tensors = [
        torch.ones(3) * (rank + 1),
        torch.ones(2, 2, dtype=torch.float64) * rank,
        torch.ones(1),
    ]
    comm.all_reduce_coalesced(tensors)
    total = sum(r + 1 for r in range(world))
    assert torch.equal(tensors[0], torch.full((3,), float(total)))
    assert torch.equal(
        tensors[1], torch.full((2, 2), float(sum(range(world))), dtype=torch.float64)
    )
    assert torch.equal(tensors[2], torch.full((1,), float(world)))
    inputs = [torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank)]
    outputs = [torch.empty(2 * world), torch.empty(3 * world)]
    work = comm.all_gather_coalesced(outputs, inputs, async_op=True)
    work.wait()
    assert torch.equal(outputs[0], torch.cat([torch.full((2,), float(r)) for r in range(world)]))
    assert torch.equal(outputs[1], torch.cat([torch.full((3,), 10.0 + r) for r in range(world)]))
    return True


def _check_queries() -> dict[str, object]:
    from shardspeed.utils.logging import current_rank

    comm.init_distributed()  # the harness already made the group: must be a no-op
    comm.init_distributed(dist_init_required=True)
    world = comm.get_world_size()
    sub = comm.new_group([0, 1])
    info = {
        "rank": comm.get_rank(),
        "world": world,
        "local": comm.get_local_rank(),
        "provider": current_rank(),
        "initialized": comm.is_initialized(),
        "all_ranks": comm.get_all_ranks_from_group(),
        "sub_ranks": comm.get_all_ranks_from_group(sub) if comm.get_rank() < 2 else None,
        "global_of_1": comm.get_global_rank(sub, 1) if comm.get_rank() < 2 else None,
        "world_group": comm.get_world_group() is dist.group.WORLD,
        "probes": (
            comm.has_all_gather_into_tensor(),
            comm.has_reduce_scatter_tensor(),
            comm.has_all_reduce_coalesced(),
        ),
    }
    return info


def test_reductions_and_broadcast(dist_pool):
    assert dist_pool(2).run(_check_reductions) == [True, True]


def test_gathers(dist_pool):
    assert dist_pool(2).run(_check_gathers) == [True, True]


def test_reduce_scatters(dist_pool):
    assert dist_pool(2).run(_check_reduce_scatters) == [True, True]


def test_all_to_all(dist_pool):
    assert dist_pool(2).run(_check_all_to_all) == [True, True]


def test_gather_scatter(dist_pool):
    assert dist_pool(2).run(_check_gather_scatter) == [True, True]


def test_point_to_point_and_barriers(dist_pool):
    assert dist_pool(2).run(_check_p2p) == [0, 1]


def test_async_ops_return_handles(dist_pool):
    assert dist_pool(2).run(_check_async_handles) == [True, True]


def test_coalesced(dist_pool):
    assert dist_pool(2).run(_check_coalesced) == [True, True]


def test_rank_queries_and_noop_init(dist_pool):
    infos = dist_pool(2).run(_check_queries)
    for rank, info in enumerate(infos):
        assert info["rank"] == rank == info["provider"] == info["local"]
        assert info["world"] == 2 and info["initialized"] and info["world_group"]
        assert info["all_ranks"] == [0, 1] and info["sub_ranks"] == [0, 1]
        assert info["global_of_1"] == 1
        assert info["probes"] == (True, True, True)


def test_collectives_on_four_ranks(dist_pool):
    pool = dist_pool(4)
    for fn in (
        _check_reductions,
        _check_gathers,
        _check_reduce_scatters,
        _check_all_to_all,
        _check_coalesced,
        _check_async_handles,
    ):
        assert pool.run(fn) == [True] * 4, fn.__name__


def _check_host_groups() -> list[int]:
    world = comm.get_world_group()
    assert comm.host_group(world) is world  # already gloo: the group itself
    # the path a NCCL group takes: each rank names its own group ({0, 1} or {2, 3}); every
    # rank makes both gloo groups and gets its own
    rank = comm.get_rank()
    mine = [0, 1] if rank < 2 else [2, 3]
    group = comm.new_host_group(mine)
    gathered = torch.empty(2, dtype=torch.int64)
    comm.all_gather_into_tensor(gathered, torch.tensor([rank * 10]), group=group)
    comm.barrier()
    return gathered.tolist()


def test_host_groups(dist_pool):
    """host_group() hands a gloo group back as is; new_host_group() makes one gloo group per
    distinct member list the ranks name, every rank taking part (torch's rule)."""
    assert dist_pool(4).run(_check_host_groups) == [[0, 10], [0, 10], [20, 30], [20, 30]]
