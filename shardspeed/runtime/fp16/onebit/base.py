"""What the three 1-bit optimizers share: argument checks, the compressed backend, the engine
hook, the freeze log line, and checkpoints that resume exactly.

The engine hook: ZeRO stage 0 asks the optimizer's :attr:`OnebitOptimizer.needs_gradient_allreduce`
before each backward (DeepSpeed's optimizer sets ``engine.enable_backward_allreduce`` instead);
after the freeze point it is False, the gradients stay local, and the optimizer averages its
compressed momentum itself.

Checkpoints: the error buffers differ from rank to rank, so :meth:`OnebitOptimizer.state_dict`
gathers every rank's (a collective: every rank calls it, as ``engine.save_checkpoint`` does)
into the first parameter group under ``"onebit"``; :meth:`load_state_dict` gives each rank its
own back. DeepSpeed resets the errors on load instead, which changes the trajectory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from shardspeed import comm
from shardspeed.runtime.comm.compressed import CompressedBackend, exchanged_bytes
from shardspeed.utils.logging import log_dist

#: DeepSpeed's comm_backend_name values; every one runs the same torch path here
COMM_BACKENDS = ("nccl", "mpi", "compressed", "hccl")
#: the parameter-group key holding the checkpointed 1-bit state
STATE_KEY = "onebit"


class OnebitConfigError(ValueError, AssertionError):
    """A bad 1-bit optimizer argument (also an AssertionError, as DeepSpeed's asserts)."""


def check_positive_int(owner: str, key: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, else OnebitConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise OnebitConfigError(f"{owner}: {key}={value!r} must be an integer >= {minimum}")
    return value


def check_range(owner: str, key: str, value: Any, low: float, high: float) -> float:
    """``value`` as a float in ``[low, high]``, else OnebitConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise OnebitConfigError(f"{owner}: {key}={value!r} must be a number in [{low}, {high}]")
    return float(value)


class OnebitOptimizer(torch.optim.Optimizer):
    """Base of OnebitAdam, ZeroOneAdam and OnebitLamb (not built directly)."""

    #: names of per-parameter state entries that differ between ranks (saved per rank)
    rank_local_keys: tuple[str, ...] = ("worker_error", "server_error")

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        deepspeed: Any,
        amsgrad: bool,
        cuda_aware: bool,
        comm_backend_name: str,
        eps_inside_sqrt: bool,
    ) -> None:
        owner = type(self).__name__
        if amsgrad:
            raise OnebitConfigError(f"{owner}: amsgrad=True is not supported; set it to false")
        if comm_backend_name not in COMM_BACKENDS:
            raise OnebitConfigError(
                f"{owner}: comm_backend_name={comm_backend_name!r} is not one of "
                f"{', '.join(COMM_BACKENDS)} (all of them run the same torch collectives here)"
            )
        lr, betas = defaults["lr"], defaults["betas"]
        check_range(owner, "lr", lr, 0.0, float("inf"))
        if not (isinstance(betas, tuple | list) and len(betas) == 2):
            raise OnebitConfigError(f"{owner}: betas={betas!r} must be two numbers in [0, 1)")
        for beta in betas:
            check_range(owner, "betas", beta, 0.0, 0.999999999)
        check_range(owner, "eps", defaults["eps"], 0.0, float("inf"))
        check_range(owner, "weight_decay", defaults["weight_decay"], 0.0, float("inf"))
        super().__init__(params, defaults)
        self.deepspeed = deepspeed
        self.cuda_aware = bool(cuda_aware)
        self.comm_backend_name = comm_backend_name
        self.eps_mode = 0 if eps_inside_sqrt else 1  # DeepSpeed's attribute: 0 = eps under sqrt
        self.backend = CompressedBackend(None)
        self._announced = False

    # -- wiring ---------------------------------------------------------------------------------
    def bind_comm_group(self, group: Any) -> None:
        """Average over ``group`` (the engine's data-parallel group) instead of the world."""
        if any(self.state.values()):
            raise RuntimeError("bind_comm_group() must come before the first step")
        self.backend = CompressedBackend(group)

    @property
    def size(self) -> int:
        """Ranks the momentum is averaged over (DeepSpeed's attribute)."""
        return self.backend.size

    @property
    def needs_gradient_allreduce(self) -> bool:
        """Whether the engine should all-reduce the gradients of the next backward."""
        raise NotImplementedError

    def params_with_grads(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """(group, parameter) for every parameter with a gradient, in order."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]

    def error_buffers(self, state: dict[str, Any], numel: int, device: Any) -> None:
        """Give ``state`` zeroed worker/server error buffers for ``numel`` elements."""
        padded = self.backend.padded_size(numel)
        state["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=device)
        state["server_error"] = torch.zeros(padded // self.size, dtype=torch.float32, device=device)

    def average_grad(self, grad: torch.Tensor) -> None:
        """Average ``grad`` over the group at full precision (``non_freeze`` groups)."""
        if self.size > 1:
            comm.all_reduce(grad, group=self.backend.group)
            grad.div_(self.size)

    def exchange(self, pending: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]) -> None:
        """Average each ``(group, param, tensor)``'s tensor over the ranks at one bit per element
        (error buffers in ``param``'s state), all in one batched exchange; then the group's
        ``exp_avg_mask`` zeroes masked elements."""
        states = [self.state[param] for _, param, _ in pending]
        for (_, _, tensor), state in zip(pending, states, strict=True):
            if "worker_error" not in state:
                self.error_buffers(state, tensor.numel(), tensor.device)
        if pending and self.size > 1:
            self.backend.compressed_allreduce_many(
                [tensor for _, _, tensor in pending],
                [state["worker_error"] for state in states],
                [state["server_error"] for state in states],
            )
        for group, _, tensor in pending:
            if "exp_avg_mask" in group:
                tensor.mul_(group["exp_avg_mask"].to(tensor.device))

    def announce_freeze(self, numel: int, exchanges: int = 1) -> None:
        """Log once, on rank 0, what the compressed exchange saves per step."""
        if self._announced:
            return
        self._announced = True
        sent, full = exchanged_bytes(numel, self.size)
        log_dist(
            f"{type(self).__name__}: compressed momentum exchange from now on: about "
            f"{sent * exchanges} bus bytes per rank per step instead of the fp32 gradient "
            f"all-reduce's {full} ({full - sent * exchanges} saved, "
            f"{full / max(sent * exchanges, 1):.1f}x less)",
            ranks=[0],
            level=logging.INFO,
        )

    # -- checkpoints ------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Optimizer-wide values a subclass checkpoints (counters, flags)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""
        del state

    def restore_local_params(self) -> bool:
        """Write again the rank-local parameter values the last :meth:`load_state_dict`
        restored, over weights loaded since (True if there were any; only 0/1 Adam has them:
        its ranks' parameters differ between synchronisations)."""
        return False

    def _ordered_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _local_state(self) -> list[dict[str, torch.Tensor]]:
        return [
            {k: v for k, v in self.state[p].items() if k in self.rank_local_keys}
            for p in self._ordered_params()
        ]

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus every rank's error buffers and the optimizer-wide state in
        ``param_groups[0]["onebit"]``. Every rank must call it (the errors are gathered)."""
        local = self._local_state()
        ranks = [local]
        if self.size > 1:
            ranks = [[] for _ in range(self.size)]
            comm.all_gather_object(ranks, local, group=self.backend.group)
        saved = super().state_dict()
        # torch's entries are the live state dicts: filter into new ones
        saved["state"] = {
            index: {k: v for k, v in entry.items() if k not in self.rank_local_keys}
            for index, entry in saved["state"].items()
        }
        groups = [dict(g) for g in saved["param_groups"]]
        groups[0][STATE_KEY] = {
            "version": 1,
            "world_size": self.size,
            "ranks": ranks,
            "extra": self.extra_state(),
        }
        return {**saved, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; each rank takes back its own error buffers."""
        groups = [dict(g) for g in state_dict["param_groups"]]
        blob = groups[0].pop(STATE_KEY, None) if groups else None
        super().load_state_dict({**state_dict, "param_groups": groups})
        for group in self.param_groups:
            group.pop(STATE_KEY, None)
        if blob is None:
            return  # a plain Adam/LAMB state: errors start at zero
        if blob["world_size"] != self.size:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint's error buffers come from "
                f"{blob['world_size']} ranks and this run has {self.size}; resume on "
                f"{blob['world_size']} ranks, or load with load_optimizer_states=False"
            )
        mine = blob["ranks"][self.backend.rank]
        for param, saved in zip(self._ordered_params(), mine, strict=True):
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    value = value.clone().to(param.device)
                self.state[param][key] = value
        self.load_extra_state(blob["extra"])
