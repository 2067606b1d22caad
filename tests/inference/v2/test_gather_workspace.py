"""The key/value gathers of paged attention land in a reused per-thread buffer (a fresh tensor
per gather costs more than the copy) and stay exact when batches grow and shrink."""

from __future__ import annotations

import importlib
import threading

import torch

# the package exports the function under the module's name: reach the module itself
pa = importlib.import_module("shardspeed.inference.v2.ragged.paged_attention")


def test_gather_reuses_its_buffer_and_is_exact() -> None:
    rows = torch.randn(100, 8)
    small, large = torch.tensor([3, 1, 4]), torch.randint(0, 100, (50,))
    first = pa._gather(rows, large, 0)
    torch.testing.assert_close(first, rows[large], atol=0, rtol=0)
    ptr = first.data_ptr()
    # a smaller gather into the same slot reuses the buffer, a larger one grows it
    again = pa._gather(rows, small, 0)
    assert again.data_ptr() == ptr
    torch.testing.assert_close(again, rows[small], atol=0, rtol=0)
    # the other slot (values) is its own buffer: keys and values are live together
    other = pa._gather(rows, small, 1)
    assert other.data_ptr() != ptr
    torch.testing.assert_close(other, rows[small], atol=0, rtol=0)
    grown = pa._gather(rows, torch.cat([large, large]), 0)
    torch.testing.assert_close(grown, rows[torch.cat([large, large])], atol=0, rtol=0)


def test_gather_buffers_are_per_thread() -> None:
    rows = torch.randn(10, 4)
    index = torch.tensor([1, 2])
    here = pa._gather(rows, index, 0).data_ptr()
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(pa._gather(rows, index, 0).data_ptr()))
    thread.start()
    thread.join()
    assert seen and seen[0] != here
