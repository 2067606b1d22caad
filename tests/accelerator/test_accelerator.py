"""Accelerator selection and the CPU backend's no-op streams, host-timed events and memory stats."""

from __future__ import annotations

import time

import pytest
import torch

from shardspeed import accelerator as acc
from shardspeed.accelerator import (
    CPU_Accelerator,
    DeepSpeedAccelerator,
    get_accelerator,
    select_accelerator,
    set_accelerator,
)


def test_env_var_selects_cpu_case_insensitively():
    assert isinstance(select_accelerator({"DS_ACCELERATOR": "CPU"}), CPU_Accelerator)
    assert isinstance(
        select_accelerator({"SHARDSPEED_ACCELERATOR": "cpu", "DS_ACCELERATOR": "bogus"}),
        CPU_Accelerator,
    )


def test_invalid_env_value_names_the_valid_ones():
    with pytest.raises(ValueError, match="SHARDSPEED_ACCELERATOR='tpu'.*cuda, mps, cpu"):
        select_accelerator({"SHARDSPEED_ACCELERATOR": "tpu"})
    with pytest.raises(ValueError, match="DeepSpeed plugin accelerator"):
        select_accelerator({"DS_ACCELERATOR": "xpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot use cuda"):
        select_accelerator({"DS_ACCELERATOR": "cuda"})


def test_auto_detection_matches_the_machine():
    expected = (
        "cuda"
        if torch.cuda.is_available()
        else "mps"
        if torch.backends.mps.is_available()
        else "cpu"
    )
    assert select_accelerator({})._name == expected


def test_get_and_set_accelerator(monkeypatch):
    previous = get_accelerator()
    try:
        mine = CPU_Accelerator(device_count=3)
        set_accelerator(mine)
        assert get_accelerator() is mine and acc.is_current_accelerator_supported()
        set_accelerator(None)
        monkeypatch.setenv("SHARDSPEED_ACCELERATOR", "cpu")
        chosen = get_accelerator()
        assert isinstance(chosen, CPU_Accelerator) and get_accelerator() is chosen
        with pytest.raises(TypeError, match="DeepSpeedAccelerator"):
            set_accelerator("cpu")  # type: ignore[arg-type]
    finally:
        set_accelerator(previous)


def test_cpu_devices_and_capabilities(monkeypatch):
    cpu = CPU_Accelerator()
    assert isinstance(cpu, DeepSpeedAccelerator)
    assert cpu.device_name() == cpu.device_name(1) == cpu.current_device_name() == "cpu"
    assert cpu.device(0) == torch.device("cpu")
    assert cpu.communication_backend_name() == "gloo"
    assert cpu.is_bf16_supported() and cpu.is_fp16_supported() and cpu.is_available()
    assert cpu.supported_dtypes() == [torch.float32, torch.float16, torch.bfloat16]
    assert cpu.is_synchronized_device() and cpu.use_host_timers()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu.device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "3")  # DeepSpeed's CPU accelerator reads this first
    assert cpu.device_count() == 3
    assert CPU_Accelerator(device_count=2).device_count() == 2
    cpu.set_device(3)
    assert cpu.current_device() == 3
    assert cpu.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"] and cpu.export_envs() == []
    env: dict[str, str] = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert cpu.on_accelerator(torch.ones(1))
    assert torch.equal(cpu.FloatTensor([1, 2]), torch.tensor([1.0, 2.0]))
    assert (
        cpu.LongTensor([1]).dtype == torch.int64 and cpu.BFloat16Tensor([1]).dtype == torch.bfloat16
    )
    assert cpu.op_builder_dir() is None and cpu.create_op_builder("CPUAdamBuilder") is None
    assert cpu.create_graph() is None


def test_cpu_streams_and_events_are_host_no_ops():
    cpu = CPU_Accelerator()
    stream = cpu.Stream()
    with stream as entered:
        assert entered is stream
    with cpu.stream(stream):
        pass
    assert cpu.current_stream() is cpu.default_stream()
    stream.synchronize()
    stream.wait_stream(cpu.current_stream())
    assert stream.query()
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    cpu.synchronize()
    assert 15 <= start.elapsed_time(end) < 2000
    with pytest.raises(RuntimeError, match="recorded"):
        cpu.Event().elapsed_time(end)
    assert isinstance(stream.record_event(), cpu.Event)


def test_cpu_memory_stats_are_ints():
    cpu = CPU_Accelerator()
    cpu.reset_peak_memory_stats()
    held = torch.ones(32 * 2**20 // 4)  # 32 MiB, touched so it is resident
    values = [
        cpu.memory_allocated(),
        cpu.max_memory_allocated(),
        cpu.memory_reserved(),
        cpu.max_memory_reserved(),
        cpu.memory_cached(),
        cpu.total_memory(),
        cpu.available_memory(),
    ]
    assert all(isinstance(v, int) and v > 0 for v in values)
    assert cpu.max_memory_allocated() >= cpu.memory_allocated() - 4096
    assert cpu.total_memory() >= cpu.available_memory()
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    cpu.reset_max_memory_allocated()
    cpu.empty_cache()
    del held


def test_cpu_pinning_and_rng():
    cpu = CPU_Accelerator()
    t = torch.ones(4)
    if not torch.cuda.is_available():
        assert cpu.pin_memory(t) is t
    assert cpu.is_pinned(t) is False
    cpu.manual_seed(123)
    state = cpu.get_rng_state()
    a = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    cpu.manual_seed_all(7)
    assert cpu.initial_seed() == 7
    assert cpu.default_generator(0) is torch.default_generator


def test_compile_backend():
    cpu = CPU_Accelerator()
    assert cpu.get_compile_backend() == "inductor"
    with pytest.raises(ValueError, match="not known to torch.compile"):
        cpu.set_compile_backend("no-such-backend")
    cpu.set_compile_backend("eager")
    assert cpu.get_compile_backend() == "eager"
