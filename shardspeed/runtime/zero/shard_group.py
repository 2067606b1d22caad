"""A shard group: parameters that reduce (and, partitioned, step) together over one process group.

A group owns its :class:`~shardspeed.runtime.zero.comm_group.CommGroup` (process group, rank,
world size), its gradient buckets, its fp32 masters, its collectives in flight and its
:class:`~shardspeed.runtime.zero.placement.Placement`; each bucket knows the dtype its gradients
travel in (its records' communication dtype). A strategy is a composition of groups: stage 0 one :class:`~.replicated_group.ReplicatedGroup`, stages 1 and 2
one :class:`~.partitioned_group.PartitionedGroup` (their gradient modes differ); Mixture of
Experts adds a group on the expert-data-parallel process group, stage 3 a group that also shards
parameters. The strategy calls every group's verbs in turn; nothing outside a group knows how it
holds its state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.comm import ProcessGroup
from shardspeed.ops.muon.layout import ShardedMatrices
from shardspeed.runtime.precision.master_weights import MasterWeights
from shardspeed.runtime.precision.overflow import has_inf_or_nan
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.runtime.zero.buckets import GradientBuckets
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.grad_norm import GradSquares
from shardspeed.runtime.zero.inflight import Inflight
from shardspeed.runtime.zero.placement import Placement
from shardspeed.runtime.zero.records import ParamRecord
from shardspeed.runtime.zero.reduce_options import GradReduceOptions, scale_grads_


@dataclass(frozen=True)
class GroupOptions:
    """What every shard group of a strategy is configured with."""

    precision: PrecisionPolicy
    reduce: GradReduceOptions
    #: ``data_types.grad_accum_dtype`` (None: the group's default)
    grad_accum_dtype: torch.dtype | None = None
    #: ``zero_optimization.ignore_unused_parameters``
    ignore_unused_parameters: bool = True
    #: how error messages name the strategy ("ZeRO stage 1")
    label: str = "ZeRO"


@dataclass(frozen=True)
class ParamFragment:
    """This rank's piece of one model parameter: elements ``param_slice`` of
    ``param.view(-1)``, with their fp32 master values, reduced gradient and optimizer state.

    ``master`` and ``grad`` are 1-D views of exactly the piece; the optimizer state of the piece is
    ``optimizer.state[state_key][name].view(-1)[state_slice]``. ``partitioned`` says whether
    other ranks of ``group`` hold the rest (then assembling the full tensor is a collective).
    ``local_grad`` is the whole gradient this rank accumulated and has not reduced yet (inside
    ``engine.no_sync()`` or before the accumulation boundary), where ``grad`` is None.
    """

    param_slice: slice
    master: torch.Tensor
    grad: torch.Tensor | None
    state_key: torch.Tensor
    state_slice: slice
    partitioned: bool
    group: ProcessGroup | None
    local_grad: torch.Tensor | None = None


class ShardGroup(ABC):
    """Parameters reduced over one process group (see the module docstring)."""

    def __init__(
        self,
        records: Sequence[ParamRecord],
        comm: CommGroup,
        placement: Placement,
        options: GroupOptions,
    ) -> None:
        self.records = list(records)
        self.comm = comm
        self.placement = placement
        self.options = options
        self.pre_scale, self.post_scale = options.reduce.scale_factors(comm.divisor)
        for record in self.records:
            record.group = self
            if record.comm_dtype is None:  # torch_autocast may have chosen one per parameter
                record.comm_dtype = options.reduce.communication_data_type
        self.inflight = Inflight(self.inflight_limit())
        self.buckets: GradientBuckets = self.build_buckets()
        self.masters: MasterWeights = self.build_masters()
        #: whether a reducing backward has run since the gradients were last zeroed
        self.reduced = False
        #: the optimizer exchanges (compressed) state itself: gradients stay local by design
        self.local_gradients = False

    # -- construction (one per kind of group) ------------------------------------------------
    @abstractmethod
    def inflight_limit(self) -> int | None:
        """How many reductions may be in flight at once (None: all until the backward ends)."""

    @abstractmethod
    def build_buckets(self) -> GradientBuckets:
        """The group's gradient buckets, with their launch callback."""

    @abstractmethod
    def build_masters(self) -> MasterWeights:
        """The tensors the optimizer steps, paired with what they update."""

    @abstractmethod
    def rebind(self, params: list[torch.Tensor], opt_group: int) -> list[torch.Tensor]:
        """Optimizer parameter group ``opt_group``'s tensor list with this group's parameters
        replaced by what the optimizer steps for them (others left in place)."""

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        self.buckets.begin(reduce)

    @abstractmethod
    def end_backward(self) -> None:
        """Launch what is left and finish every reduction."""

    # -- step -------------------------------------------------------------------------------
    @abstractmethod
    def prepare_step(self, inv_loss_scale: float) -> None:
        """Make this rank's gradients ready for the update (master dtype, unscaled)."""

    def offloaded_masters(self) -> list[torch.Tensor]:
        """The masters ZeRO-Offload keeps off the device (NVMe offload swaps their state)."""
        masters = self.masters.master_params
        chosen = self.placement.offloaded([m.numel() for m in masters])
        return [m for m, offloaded in zip(masters, chosen, strict=True) if offloaded]

    def step_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer will use."""
        return [m.grad for m in self.masters.master_params if m.grad is not None]

    def local_overflow(self) -> torch.Tensor:
        """1.0 if any gradient this rank holds is inf or nan (0-dim float tensor)."""
        return has_inf_or_nan(self.step_grads())

    @abstractmethod
    def grad_squares(self) -> GradSquares:
        """This rank's part of the squared global gradient norm."""

    def scale_gradients(self, coef: torch.Tensor) -> None:
        scale_grads_(self.step_grads(), coef)

    @abstractmethod
    def after_step(self) -> None:
        """Bring the model parameters up to date from what the optimizer stepped."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""

    def matrix_layouts(self) -> dict[int, ShardedMatrices]:
        """How each stepped tensor that is not a whole parameter holds pieces of matrices, by
        the tensor's id (for an optimizer that needs whole matrices: Muon); none by default."""
        return {}

    # -- inspection and state ---------------------------------------------------------------
    @abstractmethod
    def fragment(self, record: ParamRecord) -> ParamFragment:
        """This rank's piece of a parameter of this group."""

    @abstractmethod
    def fill_masters_from_model(self) -> None:
        """Set the masters from the model's (just loaded) weights."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The group's part of the strategy's checkpoint state."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or, given ``{}``, follow the model's weights)."""

    def destroy(self) -> None:
        self.buckets.remove_hooks()
        for record in self.records:
            record.group = None
