"""RNG streams for model parallelism and RNG snapshots for exact recompute.

Two things live here:

* :class:`CudaRNGStatesTracker`, DeepSpeed/Megatron's tracker of named device RNG streams. A
  model-parallel layer draws its dropout masks inside ``tracker.fork(name)`` so that ranks of a
  tensor-parallel group, which hold different shards, draw *different* masks, while the default
  stream stays identical across them. On a host-only machine the "device" RNG is the CPU
  generator (the accelerator answers with it), so the tracker works there too.
* :class:`RNGSnapshot`: the CPU, device and tracker states taken before a checkpointed forward,
  restored around its recompute so that dropout draws the same mask twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.runtime.activation_checkpointing.state import model_parallel_rank

__all__ = [
    "CudaRNGStatesTracker",
    "RNGSnapshot",
    "_CUDA_RNG_STATE_TRACKER",
    "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_seeds",
]

# Megatron's and DeepSpeed's name for the tensor-parallel stream; user code imports it.
_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

# DeepSpeed/Megatron convention: the model-parallel stream starts this far from the base seed,
# so it never coincides with the data-parallel (default) stream seeded with the base seed.
MODEL_PARALLEL_SEED_OFFSET = 2718


def _device_is_host() -> bool:
    """True when the accelerator's RNG *is* the CPU generator (no separate device stream)."""
    return get_accelerator().device_name() == "cpu"


class CudaRNGStatesTracker:
    """Named device RNG states: ``add`` a stream with its seed, draw from it inside ``fork``.

    Each stream's state is kept here between forks; the device generator is switched to it on
    entering ``fork`` and the stream's advanced state is stored back on leaving.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state mapping (the state tensors are never mutated in place)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace every stream's state, e.g. with one taken by :meth:`get_states`."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; names and seeds must be unused."""
        if seed in self.seeds_:
            raise ValueError(
                f"RNG seed {seed} is already used by another stream of the tracker; "
                f"give stream {name!r} a different seed."
            )
        if name in self.states_:
            raise ValueError(
                f"RNG stream {name!r} already exists in the tracker; call reset() first to "
                "re-seed it."
            )
        self.seeds_.add(seed)
        accel = get_accelerator()
        # seed the device generator only long enough to read the stream's starting state
        saved = accel.get_rng_state()
        accel.manual_seed(seed)
        self.states_[name] = accel.get_rng_state()
        accel.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is left untouched."""
        if name not in self.states_:
            raise KeyError(
                f"RNG stream {name!r} is not in the tracker (known: {sorted(self.states_)}); "
                "call model_parallel_cuda_manual_seed(seed) or tracker.add(name, seed) first."
            )
        accel = get_accelerator()
        outer = accel.get_rng_state()
        accel.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accel.get_rng_state()
            accel.set_rng_state(outer)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker (DeepSpeed's name; it tracks CPU states where there is no GPU)."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_seeds(seed: int, mp_rank: int) -> tuple[int, int]:
    """``(data_parallel_seed, model_parallel_seed)`` for ``seed`` on model-parallel rank
    ``mp_rank``: the default stream gets ``seed`` (same on every model-parallel rank) and the
    model-parallel stream ``seed + 2718 + mp_rank`` (different on each)."""
    return seed, seed + MODEL_PARALLEL_SEED_OFFSET + mp_rank


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default device stream with ``seed`` and the tracker's model-parallel stream with
    ``seed + 2718 + model-parallel rank``, the rank coming from the configured mpu (0 without)."""
    data_parallel_seed, mp_seed = model_parallel_seeds(seed, model_parallel_rank())
    _CUDA_RNG_STATE_TRACKER.reset()
    get_accelerator().manual_seed(data_parallel_seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, mp_seed)


@dataclass(frozen=True)
class RNGSnapshot:
    """CPU, device and tracker RNG states at one moment."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls) -> RNGSnapshot:
        """The current states (the device state is omitted when the device RNG is the CPU's)."""
        device = None if _device_is_host() else get_accelerator().get_rng_state()
        return cls(torch.get_rng_state(), device, get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        """Make these the current states."""
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            get_accelerator().set_rng_state(self.device)
        get_cuda_rng_tracker().set_states(self.tracker)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block from this snapshot, then put back the states found on entry, so a
        recompute neither changes nor is changed by the RNG streams around it."""
        outer = RNGSnapshot.capture()
        self.restore()
        try:
            yield
        finally:
            outer.restore()
