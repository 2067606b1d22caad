"""The global gradient norm and the overflow verdict, from every shard group's local part,
reduced once over the right process groups.

Each shard group reports :class:`GradSquares`: the sum of squares of the gradients it holds on
this rank, and over which group that sum is split. A replicated group (stage 0) holds the whole
reduced gradient on every rank, so its sum is already complete; a partitioned group (stages
1-3) holds one piece per rank of its process group, so its sums are added over that group. Sums
split over the same group are added before the one all-reduce of that group. Pipeline and
tensor parallelism split parameters across further ranks: ``model_parallel`` adds the total
over them (None until those axes exist). Expert parameters (Mixture of Experts) are spread over
their expert-parallel group too, each rank holding other experts: their sums are also added over
that group (``spread_over``), so every expert counts once.

A replicated group's sum is the square of its float32 norm of per-tensor norms (exact in
float64), so a single replicated group yields exactly ``torch.nn.utils.clip_grad_norm_``'s
norm; partitioned sums are float64, which keeps them within an ulp of the true norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardspeed import comm
from shardspeed.runtime.zero.comm_group import CommGroup


@dataclass(frozen=True)
class GradSquares:
    """A 0-dim float64 sum of squares, the group it is split over (None: complete) and the
    group holding other parameters of its kind (None: none)."""

    value: torch.Tensor
    split_over: CommGroup | None
    spread_over: CommGroup | None = None


def _spread(group: CommGroup | None) -> CommGroup | None:
    spread = None if group is None else group.spread_over
    return spread if spread is not None and spread.partitioned else None


def replicated_squares(
    grads: Sequence[torch.Tensor], device: torch.device, group: CommGroup | None = None
) -> GradSquares:
    """The squares of gradients every rank of ``group`` holds whole."""
    if not grads:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return GradSquares(zero, None, _spread(group))
    norms = torch._foreach_norm(list(grads), 2.0)
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    return GradSquares(norm.double().square(), None, _spread(group))


def partitioned_squares(
    grads: Sequence[torch.Tensor], device: torch.device, group: CommGroup
) -> GradSquares:
    """The squares of this rank's pieces of gradients split over ``group``."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    if grads:
        # per device: offloaded masters' gradients sit in host memory, the rest on the device
        for on_device in _by_device(grads).values():
            # one cast of the stacked norms, not one per gradient (a launch each on a GPU)
            norms = torch.stack(torch._foreach_norm(on_device, 2.0)).double()
            squares = squares + norms.square().sum().to(device)
    return GradSquares(squares, group if group.partitioned else None, _spread(group))


def _by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    found: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        found.setdefault(tensor.device, []).append(tensor)
    return found


class GradNormReducer:
    """Combines the groups' squares into the global norm, and their overflow flags into one
    verdict every rank shares."""

    def __init__(self, model_parallel: CommGroup | None = None) -> None:
        self.model_parallel = model_parallel

    def global_norm(self, parts: Sequence[GradSquares], device: torch.device) -> torch.Tensor:
        """The L2 norm of the full gradient (0-dim float32)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        split: dict[tuple[CommGroup | None, CommGroup | None], torch.Tensor] = {}
        for part in parts:
            key = (part.split_over, part.spread_over)
            previous = split.get(key)
            split[key] = part.value if previous is None else previous + part.value
        for (over, spread), value in split.items():
            for group in (over, spread):
                if group is not None:
                    comm.all_reduce(value, group=group.group)
            total = total + value
        if self.model_parallel is not None and self.model_parallel.partitioned:
            comm.all_reduce(total, group=self.model_parallel.group)
        return total.sqrt().float()

    @staticmethod
    def any_overflow(flags: Sequence[torch.Tensor], device: torch.device) -> bool:
        """Whether any rank of the job saw an inf or nan in any group (every rank must skip the
        step together, so this reduces over the whole world)."""
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for local in flags:
            flag = torch.maximum(flag, local.float().to(device).reshape(()))
        flag = flag.reshape(1)
        if comm.is_initialized() and comm.get_world_size() > 1:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        return bool(flag.item())
