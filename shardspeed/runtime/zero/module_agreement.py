"""The check that keeps ZeRO-3 from hanging when ranks take different branches.

Before a module's parameters are gathered, in forward and again in backward, every rank
all-gathers (unit index, phase). If the ranks are not all about to run the same module, they
would issue different all-gathers and wait for each other forever; instead every rank raises an
error naming each rank's module and the fix (mark the routing module as a leaf). The cost is one
2-element all-gather per module call, over a host (gloo) group of the same ranks, so on a GPU the
check never waits for the device's stream: only for the other ranks' processes to get there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed import comm
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.gather_units import GatherUnit

#: the phases a unit is fetched in
FORWARD, BACKWARD = 0, 1
_PHASE_NAMES = {FORWARD: "forward", BACKWARD: "backward"}


def describe_unit(units: Sequence[GatherUnit], index: int) -> str:
    """How error messages name unit ``index``: its module's path and class."""
    if 0 <= index < len(units):
        unit = units[index]
        return f"{unit.name or '<root>'} ({type(unit.module).__name__})"
    return f"unit {index}"


class ModuleAgreement:
    """Checks, over ``comm``, that every rank fetches the same unit in the same phase."""

    def __init__(self, comm_group: CommGroup, units: Sequence[GatherUnit]) -> None:
        self.comm = comm_group
        self.units = units
        self._host = comm.host_group(comm_group.group) if comm_group.partitioned else None

    def check(self, unit: GatherUnit, phase: int) -> None:
        if not self.comm.partitioned:
            return
        mine = torch.tensor([unit.index, phase], dtype=torch.int64)
        everyone = torch.empty(2 * self.comm.world_size, dtype=torch.int64)
        comm.all_gather_into_tensor(everyone, mine, group=self._host)
        rows = [tuple(row) for row in everyone.view(-1, 2).tolist()]
        if all(row == rows[0] for row in rows):
            return
        where = "; ".join(
            f"rank {rank}: {_PHASE_NAMES[ph]} of {describe_unit(self.units, index)}"
            for rank, (index, ph) in enumerate(rows)
        )
        raise RuntimeError(
            "ZeRO stage 3: the ranks are about to run different modules, so they would gather "
            f"different parameters and wait for each other forever ({where}). Every rank must "
            "run the same modules in the same order; mark a module whose children run "
            "differently per rank (a Mixture-of-Experts layer) as a leaf with "
            "shardspeed.utils.set_z3_leaf_modules or zero_optimization.leaf_module"
        )

    def all_succeeded(self, failure: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed to ``what`` (``failure``: this rank's error),
        so no rank goes on into a collective the failed one will never join."""
        if self.comm.partitioned:  # (a None group is the world)
            flag = torch.tensor([0.0 if failure is None else 1.0])
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self._host)
            if failure is None and flag.item() > 0:
                raise RuntimeError(
                    f"another rank failed to {what} (its error names the cause); this rank "
                    "stops too"
                )
        if failure is not None:
            raise failure
