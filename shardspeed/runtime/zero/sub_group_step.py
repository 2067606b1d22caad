"""The optimizer step ``sub_group_size`` elements at a time (DeepSpeed's sub-groups).

The optimizer's temporaries then cover one sub-group, not every partition at once, and under
``offload_optimizer.device: nvme`` the state of the next sub-group is read while one steps and
the last one's is written behind it (:class:`~.state_swap.OptimizerStateSwap`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.runtime.zero.state_swap import Item, SwapStore

#: (optimizer parameter group index, the tensors of that group stepped together)
Run = tuple[int, list[torch.Tensor]]


def sub_group_runs(groups: Sequence[Sequence[torch.Tensor]], size: int) -> list[Run]:
    """Runs of at most ``size`` elements (a larger tensor alone), in order, never spanning
    two optimizer parameter groups; one run per group when ``size`` is 0."""
    runs: list[Run] = []
    for index, tensors in enumerate(groups):
        run: list[torch.Tensor] = []
        numel = 0
        for tensor in tensors:
            if run and size > 0 and numel + tensor.numel() > size:
                runs.append((index, run))
                run, numel = [], 0
            run.append(tensor)
            numel += tensor.numel()
        if run:
            runs.append((index, run))
    return runs


class SubGroupStepper:
    """Steps ``optimizer`` run by run, swapping the state of ``swapped`` tensors (by id) in
    and out through ``swap`` when one is given."""

    def __init__(
        self,
        size: int,
        swap: SwapStore | None,
        swapped: Sequence[torch.Tensor],
        resident: Sequence[str] = (),
    ) -> None:
        self.size = size
        #: optimizer state names kept in memory even for swapped tensors
        self.resident = frozenset(resident)
        self.swap = swap
        self._swapped = {id(t) for t in swapped}
        #: each swapped tensor's number, which names its state files
        self._number = {id(t): n for n, t in enumerate(swapped)}

    def state_items(
        self, optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor]
    ) -> list[Item]:
        """The swapped state tensors of ``tensors``, keyed by file name."""
        if self.swap is None:
            return []
        items: list[Item] = []
        for tensor in tensors:
            shard_key = self.swap.key_of(tensor)  # a parameter shard stepped in place
            if shard_key is not None:
                items.append((shard_key, tensor))
            if id(tensor) not in self._swapped:
                continue
            state = optimizer.state.get(tensor, {})
            for name, value in sorted(state.items()):
                if name in self.resident:
                    continue
                if isinstance(value, torch.Tensor) and value.numel() == tensor.numel() > 1:
                    items.append((f"master{self._number[id(tensor)]}_{name}", value))
        return items

    def all_items(self, optimizer: torch.optim.Optimizer) -> list[Item]:
        return self.state_items(optimizer, [p for g in optimizer.param_groups for p in g["params"]])

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        everything = [list(group["params"]) for group in groups]
        total = sum(t.numel() for params in everything for t in params)
        if self.swap is None and (self.size <= 0 or total <= self.size):
            optimizer.step()
            return
        runs = sub_group_runs(everything, self.size if total > self.size else 0)
        swap = self.swap
        try:
            reading = (
                [] if swap is None else swap.start_reads(self.state_items(optimizer, runs[0][1]))
            )
            for number, (index, run) in enumerate(runs):
                if swap is not None:
                    swap.wait(reading)
                    if number + 1 < len(runs):
                        upcoming = self.state_items(optimizer, runs[number + 1][1])
                        reading = swap.start_reads(upcoming)
                for position, group in enumerate(groups):
                    group["params"] = run if position == index else []
                optimizer.step()
                if swap is not None:
                    swap.finish_writes()  # the sub-group before: at most three in memory
                    stepped = self.state_items(optimizer, run)
                    swap.touch([key for key, _ in stepped])
                    swap.start_writes(stepped)
            if swap is not None:
                swap.finish_writes()
        finally:
            for group, params in zip(groups, everything, strict=True):
                group["params"] = params
