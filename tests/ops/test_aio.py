"""DeepSpeed's ``ops.aio.aio_handle`` (what ``AsyncIOBuilder().load()`` returns): tensors to
files and back, synchronous and asynchronous, split into blocks over threads."""

from __future__ import annotations

import pytest
import torch

from shardspeed.ops.op_builder import AsyncIOBuilder
from shardspeed.runtime.swap.errors import SwapError


def _handle(**kwargs):
    builder = AsyncIOBuilder()
    assert builder.is_compatible()
    return builder.load().aio_handle(**kwargs)


@pytest.mark.parametrize("threads", [1, 3])
def test_round_trips_sync_and_async(tmp_path, threads):
    handle = _handle(block_size=4096, queue_depth=8, intra_op_parallelism=threads)
    assert (handle.get_block_size(), handle.get_queue_depth()) == (4096, 8)
    assert handle.get_intra_op_parallelism() == threads
    values = [torch.randn(10_001), torch.arange(3 * 5000, dtype=torch.int64)]
    for index, value in enumerate(values):
        path = str(tmp_path / f"sync{index}.bin")
        assert handle.sync_pwrite(value, path) == 1
        back = torch.empty_like(value)
        assert handle.sync_pread(back, path) == 1
        assert torch.equal(back, value)
        assert handle.write(value, path, True) == 1  # with validation
    outs = [torch.empty_like(v) for v in values]
    for index, value in enumerate(values):
        handle.async_pwrite(value, str(tmp_path / f"async{index}.bin"))
    assert handle.wait() == 2
    for index, out in enumerate(outs):
        handle.pread(out, str(tmp_path / f"async{index}.bin"), False, True)
    assert handle.wait() == 2
    assert all(torch.equal(o, v) for o, v in zip(outs, values, strict=True))


def test_locked_tensors_and_errors(tmp_path):
    handle = _handle()
    locked = handle.new_cpu_locked_tensor(128, torch.empty(0, dtype=torch.float16))
    assert locked.dtype == torch.float16 and locked.numel() == 128
    assert handle.free_cpu_locked_tensor(locked) and not handle.free_cpu_locked_tensor(locked)
    small = tmp_path / "small.bin"
    handle.sync_pwrite(torch.zeros(10), str(small))
    with pytest.raises(SwapError, match="shorter"):
        handle.sync_pread(torch.empty(100), str(small))
    with pytest.raises(FileNotFoundError):
        handle.sync_pread(torch.empty(10), str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        handle.sync_pwrite(torch.zeros(4, 4).t(), str(small))
