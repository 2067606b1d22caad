"""TensorSwapper: round trips, a full queue, short reads, I/O errors, disk full, bad folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardspeed.config.aio import AioConfig
from shardspeed.runtime.swap import ALIGNMENT, SwapError, SwapPathError, TensorSwapper
from shardspeed.runtime.swap.aligned import direct_io_supported, round_up

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
]
# sizes in elements: empty, tiny, unaligned, exactly one block, many blocks plus a ragged tail
SIZES = [0, 1, 7, 1023, 4096, 65_537, 300_001]


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i, (dtype, n) in enumerate((d, n) for d in DTYPES for n in SIZES):
        raw = torch.randn(n, generator=gen) * 50
        out[f"t{i}/{dtype}:{n}"] = raw > 0 if dtype == torch.bool else raw.to(dtype)
    return out


def direct_modes(folder: Path) -> list[bool]:
    return [False, True] if direct_io_supported(folder) else [False]


def read_back(swapper: TensorSwapper, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    swapper.read(key, out).wait()
    return out


@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_round_trip_mixed_dtypes_and_sizes(
    tmp_path: Path, direct: bool, single_submit: bool
) -> None:
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    aio = AioConfig(
        block_size=16_384, queue_depth=4, intra_op_parallelism=2, single_submit=single_submit
    )
    data = tensors()
    with TensorSwapper(tmp_path, aio, o_direct=direct) as swapper:
        assert swapper.direct is direct
        handles = [swapper.write(k, t) for k, t in data.items()]  # all in flight at once
        swapper.wait_all()
        assert all(h.done() for h in handles)
        outs = {k: torch.empty_like(t) for k, t in data.items()}
        for h in [swapper.read(k, outs[k]) for k in data]:
            h.wait()
        for k, t in data.items():
            assert torch.equal(outs[k], t), k
        # overwrite in place with other contents and another size, then read again
        swapper.write("t3/torch.float32:1023", data["t6/torch.float32:300001"]).wait()
        assert torch.equal(
            read_back(swapper, "t3/torch.float32:1023", data["t6/torch.float32:300001"]),
            data["t6/torch.float32:300001"],
        )
        files = {swapper.path(k) for k in data}
        assert all(os.path.dirname(f) == str(tmp_path) for f in files)
    assert not any(os.path.exists(f) for f in files)  # close() removes the scratch files


def test_aligned_buffers_move_without_bounce(tmp_path: Path) -> None:
    with TensorSwapper(tmp_path, AioConfig(block_size=8192)) as swapper:
        buf = swapper.allocate(10 * ALIGNMENT, torch.float32)
        assert buf.data_ptr() % ALIGNMENT == 0
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32))
        swapper.write("aligned", buf).wait()
        out = swapper.allocate(buf.numel(), torch.float32)
        swapper.read("aligned", out).wait()
        assert torch.equal(out, buf)


def test_overlap_events_off_serialises_but_completes(tmp_path: Path) -> None:
    aio = AioConfig(block_size=4096, queue_depth=2, overlap_events=False)
    data = tensors(1)
    with TensorSwapper(tmp_path, aio) as swapper:
        for k, t in data.items():
            swapper.write(k, t)
        swapper.wait_all()
        for k, t in data.items():
            assert torch.equal(read_back(swapper, k, t), t)


@pytest.mark.parametrize("threads", [1, 3])
def test_full_queue_waits_instead_of_failing(tmp_path: Path, threads: int) -> None:
    """Far more requests than queue_depth x threads: the submitter waits for slots."""
    aio = AioConfig(
        block_size=4096, queue_depth=1, intra_op_parallelism=threads, single_submit=True
    )
    gen = torch.Generator().manual_seed(3)
    data = {f"k{i}": torch.randn(5000 + i, generator=gen) for i in range(64)}  # ~5 blocks each
    with TensorSwapper(tmp_path, aio) as swapper:
        handles = [swapper.write(k, t) for k, t in data.items()]
        for h in handles:
            h.wait()
        outs = {k: torch.empty_like(t) for k, t in data.items()}
        handles = [swapper.read(k, outs[k]) for k in data]
        swapper.wait_all()
        assert all(h.done() for h in handles)
        assert all(torch.equal(outs[k], t) for k, t in data.items())


@pytest.mark.parametrize("direct", [False, True])
def test_short_read_is_a_swap_error_and_other_keys_survive(tmp_path: Path, direct: bool) -> None:
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    keep, victim = torch.randn(50_000), torch.randn(50_000)
    with TensorSwapper(tmp_path, AioConfig(block_size=65_536), o_direct=direct) as swapper:
        swapper.write("keep", keep).wait()
        swapper.write("victim", victim).wait()
        os.truncate(swapper.path("victim"), 100_000)  # behind the swapper's back
        with pytest.raises(SwapError, match="short read") as info:
            swapper.read("victim", torch.empty_like(victim)).wait()
        err = info.value
        assert err.path == swapper.path("victim")
        assert err.got is not None and err.expected is not None and err.got < err.expected
        assert "victim" in str(err) and "Fix:" in str(err)
        assert torch.equal(read_back(swapper, "keep", keep), keep)
        swapper.write("victim", victim).wait()  # writing again repairs it
        assert torch.equal(read_back(swapper, "victim", victim), victim)


def test_closed_descriptor_write_error_marks_key_invalid(tmp_path: Path) -> None:
    keep, victim = torch.randn(20_000), torch.randn(20_000)
    with TensorSwapper(tmp_path, AioConfig(block_size=8192)) as swapper:
        swapper.write("keep", keep).wait()
        swapper.write("victim", victim).wait()
        file = swapper._files["victim"]
        os.close(file.fd)  # an injected fault: the descriptor dies under the swapper
        with pytest.raises(SwapError, match="I/O error") as info:
            swapper.write("victim", victim * 2).wait()
        assert info.value.path == swapper.path("victim") and info.value.offset is not None
        swapper.wait_all()  # the error was already raised to its waiter: not raised twice
        with pytest.raises(SwapError, match="no valid data"):  # never a torn file as data
            swapper.read("victim", torch.empty_like(victim))
        assert torch.equal(read_back(swapper, "keep", keep), keep)
        file.fd = os.open(file.path, os.O_RDWR)  # let close() tidy up
        swapper.remove("victim")
        assert "victim" not in swapper


def test_injected_eio_mid_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardspeed.runtime.swap.swap_file as swap_file

    real = os.pwrite
    calls = {"n": 0}

    def flaky(fd: int, data: memoryview, offset: int) -> int:
        calls["n"] += 1
        if offset >= 16_384:
            raise OSError(5, "Input/output error")
        return real(fd, data, offset)

    keep, victim = torch.randn(30_000), torch.randn(30_000)
    with TensorSwapper(tmp_path, AioConfig(block_size=8192)) as swapper:
        swapper.write("keep", keep).wait()
        swapper.write("victim", victim).wait()
        monkeypatch.setattr(swap_file.os, "pwrite", flaky)
        handle = swapper.write("victim", victim + 1)
        with pytest.raises(SwapError, match="Input/output error"):
            swapper.wait_all()  # wait_all reports it too
        assert handle.done()
        monkeypatch.setattr(swap_file.os, "pwrite", real)
        with pytest.raises(SwapError, match="no valid data"):
            swapper.read("victim", torch.empty_like(victim))
        assert torch.equal(read_back(swapper, "keep", keep), keep)


def test_reserve_on_a_full_disk_fails_before_writing(tiny_fs: Path) -> None:
    old = torch.arange(64_000, dtype=torch.float32)  # 256 KB
    with TensorSwapper(tiny_fs, AioConfig(block_size=65_536)) as swapper:
        swapper.write("state", old).wait()
        with pytest.raises(SwapError, match="not enough space") as info:
            swapper.reserve("more", 2_000_000)
        msg = str(info.value)
        assert "needs" in msg and "free" in msg and str(tiny_fs) in msg
        assert "more" not in swapper and not any(
            p.name.startswith("more") for p in tiny_fs.iterdir()
        )
        # overwriting with something larger fails at write(), before a byte of "state" changes
        with pytest.raises(SwapError, match="previous contents kept"):
            swapper.write("state", torch.zeros(400_000))
        assert torch.equal(read_back(swapper, "state", old), old)
        assert os.path.getsize(swapper.path("state")) == round_up(256_000)  # no growth kept
        swapper.reserve("fits", 300_000)  # what fits still fits after the failure
        swapper.write("fits", torch.ones(75_000)).wait()


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SwapPathError, match="nvme_path .*does not exist") as info:
        TensorSwapper(missing)
    assert isinstance(info.value, ValueError) and str(missing) in str(info.value)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(SwapPathError, match="not a folder"):
        TensorSwapper(a_file)


def test_unwritable_folder_is_a_clear_error(read_only_fs: Path) -> None:
    with pytest.raises(SwapPathError, match="not writable") as info:
        TensorSwapper(read_only_fs)
    assert str(read_only_fs) in str(info.value)


def test_bad_requests(tmp_path: Path) -> None:
    with TensorSwapper(tmp_path) as swapper:
        with pytest.raises(SwapError, match="no swap data"):
            swapper.read("absent", torch.empty(3))
        swapper.write("x", torch.randn(10)).wait()
        with pytest.raises(ValueError, match="40 were saved"):
            swapper.read("x", torch.empty(11))
        with pytest.raises(ValueError, match="contiguous"):
            swapper.write("y", torch.randn(4, 4).t())
        swapper.rename("x", "z")
        assert "x" not in swapper and swapper.nbytes("z") == 40
    with pytest.raises(RuntimeError, match="closed"):
        swapper.write("x", torch.randn(1))


def test_use_gds_warns_and_goes_on(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="GPUDirect"):
        swapper = TensorSwapper(tmp_path, AioConfig(use_gds=True))
    with swapper:
        swapper.write("k", torch.ones(3)).wait()


def test_filesystem_without_o_direct_falls_back_to_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where open(O_DIRECT) fails with EINVAL (tmpfs on older kernels, some network
    filesystems) the swapper uses buffered I/O; asking for O_DIRECT there is a clear error."""
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    assert not direct_io_supported(tmp_path)
    data = tensors(2)
    with TensorSwapper(tmp_path, AioConfig(block_size=8192)) as swapper:
        assert swapper.direct is False
        for k, t in data.items():
            swapper.write(k, t)
        swapper.wait_all()
        for k, t in data.items():
            assert torch.equal(read_back(swapper, k, t), t)
    with pytest.raises(SwapPathError, match="does not support O_DIRECT"):
        TensorSwapper(tmp_path, o_direct=True)
