"""The RNG tracker and model_parallel_cuda_manual_seed (CPU RNG stands in for the device's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardspeed.checkpointing as ckpt
from shardspeed.runtime.activation_checkpointing.rng import RNGSnapshot, model_parallel_seeds


def _state_after_seed(seed: int) -> torch.Tensor:
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    state = torch.get_rng_state()
    torch.set_rng_state(saved)
    return state


def test_add_and_fork_use_a_separate_stream() -> None:
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("mp", 123)
    torch.manual_seed(5)
    outer = torch.get_rng_state()
    with tracker.fork("mp"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream did not move
    with tracker.fork("mp"):
        second = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.cat([first, second]), torch.rand(8))  # one continuous stream


def test_get_set_states_and_reset() -> None:
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 1)
    saved = tracker.get_states()
    with tracker.fork("a"):
        drawn = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), drawn)
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # name and seed are free again


def test_add_refuses_reused_name_or_seed_and_fork_unknown() -> None:
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("nope"):
            pass


class _MPU:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.size

    def get_model_parallel_group(self) -> None:
        return None


@pytest.mark.parametrize("mp_rank", [0, 3])
def test_model_parallel_cuda_manual_seed_convention(mp_rank: int) -> None:
    ckpt.configure(_MPU(mp_rank, 4))
    assert model_parallel_seeds(1000, mp_rank) == (1000, 1000 + 2718 + mp_rank)
    ckpt.model_parallel_cuda_manual_seed(1000)
    assert torch.equal(torch.get_rng_state(), _state_after_seed(1000))
    states = ckpt.get_cuda_rng_tracker().get_states()
    assert list(states) == [ckpt._MODEL_PARALLEL_RNG_TRACKER_NAME]
    assert torch.equal(
        states[ckpt._MODEL_PARALLEL_RNG_TRACKER_NAME], _state_after_seed(3718 + mp_rank)
    )
    ckpt.model_parallel_cuda_manual_seed(1000)  # re-seeding resets the tracker, no error


def test_unconfigured_seed_uses_rank_zero() -> None:
    ckpt.model_parallel_cuda_manual_seed(7)
    state = ckpt.get_cuda_rng_tracker().get_states()[ckpt._MODEL_PARALLEL_RNG_TRACKER_NAME]
    assert torch.equal(state, _state_after_seed(7 + 2718))


def test_snapshot_replay_restores_and_puts_back() -> None:
    ckpt.get_cuda_rng_tracker().add("s", 9)
    snap = RNGSnapshot.capture()
    first = torch.rand(2)
    with ckpt.get_cuda_rng_tracker().fork("s"):
        first_tracked = torch.rand(2)
    outer = RNGSnapshot.capture()
    with snap.replay():
        assert torch.equal(torch.rand(2), first)
        with ckpt.get_cuda_rng_tracker().fork("s"):
            assert torch.equal(torch.rand(2), first_tracked)
    after = RNGSnapshot.capture()
    assert torch.equal(after.cpu, outer.cpu)
    assert torch.equal(after.tracker["s"], outer.tracker["s"])


def test_tracker_dropout_in_checkpoint_same_mask_and_grads() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(lin(t), 0.5)  # default stream
        with ckpt.get_cuda_rng_tracker().fork():
            return nn.functional.dropout(h, 0.5)  # model-parallel stream

    results = []
    for fn in (lambda f, t: f(t), ckpt.checkpoint):
        ckpt.model_parallel_cuda_manual_seed(42)
        x.grad = lin.weight.grad = None
        out = fn(block, x)
        out.sum().backward()
        results.append((out.detach(), x.grad.clone(), lin.weight.grad.clone()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
