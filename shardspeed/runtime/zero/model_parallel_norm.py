"""The global gradient norm under model parallelism: the job's topology with tensor-parallel
or pipeline axes (from a Megatron ``mpu`` or a pipeline grid).

DeepSpeed's rule (``clip_grad_norm_`` and the ZeRO optimizers given an ``mpu``): each rank adds
the squares of the gradients it holds, the data-parallel sums are added as ZeRO splits them, and
the total is added over the model-parallel group (the topology's ``pp`` x ``tp`` ranks: tensor-
parallel shards and pipeline stages). A parameter split over the tensor-parallel ranks (``tensor_model_parallel`` or
``model_parallel`` set true, :func:`is_model_parallel_parameter`) counts on every one of them; a
parameter every tensor-parallel rank holds whole (a layer norm, the bias of a row-parallel
linear) counts on tensor-parallel rank 0 only. Tied pipeline weights likewise count on the first
stage that holds them only.

The shard groups report the squares of everything this rank holds; what it holds but does not
count is subtracted here (:func:`uncounted_squares`), from this rank's piece of the unscaled
gradients, split over the same process group as its shard group's own part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardspeed.comm.parallel_topology import ParallelTopology
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.grad_norm import GradNormReducer, GradSquares
from shardspeed.runtime.zero.strategy import ZeroStrategy


def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the tensor-parallel ranks (Megatron marks such
    parameters ``tensor_model_parallel``, older versions ``model_parallel``)."""
    return bool(getattr(param, "model_parallel", False)) or bool(
        getattr(param, "tensor_model_parallel", False)
    )


def model_parallel_comm(topology: ParallelTopology) -> CommGroup | None:
    """The ranks holding one copy of the model together (tensor shards and pipeline stages:
    the topology's ``pp`` x ``tp`` group), or None where there is no model parallelism."""
    if topology.size("pp", "tp") <= 1:
        return None
    return CommGroup.of(topology.group("pp", "tp"))  # None: the world (a pipeline grid's)


def tensor_parallel_duplicates(model: nn.Module, topology: ParallelTopology) -> list[nn.Parameter]:
    """The parameters this rank holds but another tensor-parallel rank counts: those held
    whole (counted on rank 0) and pieces several ranks hold (a key/value head shared by more
    ranks than there are heads, marked ``tp_duplicate``: counted on the first of them)."""
    first = topology.local_rank("tp") == 0
    return [
        p
        for p in model.parameters()
        if getattr(p, "tp_duplicate", False) or (not first and not is_model_parallel_parameter(p))
    ]


def uncounted_squares(strategy: ZeroStrategy, params: Sequence[torch.Tensor]) -> list[GradSquares]:
    """Minus the squares of ``params``' gradients (this rank's pieces, unscaled), one part per
    shard group so each is split over the group that splits its own squares."""
    device = strategy.placement.device
    parts: dict[tuple[CommGroup | None, CommGroup | None], torch.Tensor] = {}
    for param in params:
        record = strategy.registry.get(param)
        fragment = strategy.param_fragment(param)  # type: ignore[arg-type]
        if record is None or record.group is None or fragment is None:
            continue  # not trained: no shard group reports it
        grad = fragment.state_key.grad
        if grad is None:
            continue
        piece = grad.reshape(-1)[fragment.state_slice]
        own = record.group.comm
        spread = own.spread_over if own.spread_over and own.spread_over.partitioned else None
        key = (own if fragment.partitioned else None, spread)
        square = piece.double().square().sum().to(device)
        parts[key] = parts.get(key, torch.zeros((), dtype=torch.float64, device=device)) + square
    return [GradSquares(-total, over, spread) for (over, spread), total in parts.items()]


class ModelParallelNormReducer(GradNormReducer):
    """:class:`GradNormReducer` adding the total over the model-parallel group, with the
    squares of ``uncounted`` (parameters this rank holds but another rank counts) taken out."""

    def __init__(
        self,
        model_parallel: CommGroup | None,
        strategy: ZeroStrategy,
        uncounted: Sequence[torch.Tensor] = (),
    ) -> None:
        super().__init__(model_parallel)
        self.strategy = strategy
        self.uncounted = list(uncounted)

    def global_norm(self, parts: Sequence[GradSquares], device: torch.device) -> torch.Tensor:
        extra = uncounted_squares(self.strategy, self.uncounted) if self.uncounted else []
        return super().global_norm([*parts, *extra], device)


def model_parallel_reducer(
    strategy: ZeroStrategy,
    model: nn.Module,
    topology: ParallelTopology,
    also_uncounted: Sequence[torch.Tensor] = (),
) -> GradNormReducer:
    """The norm reducer for ``model`` on ``topology``: over the data-parallel groups alone
    without model parallelism; with it, also over the model-parallel group (pipeline stages
    and tensor shards), each parameter counted once."""
    model_parallel = model_parallel_comm(topology)
    duplicates = tensor_parallel_duplicates(model, topology) if model_parallel is not None else []
    # a tied weight every tensor-parallel rank holds whole is left out once, not twice
    uncounted = list({id(p): p for p in [*duplicates, *also_uncounted]}.values())
    if model_parallel is None and not uncounted:
        return GradNormReducer()
    return ModelParallelNormReducer(model_parallel, strategy, uncounted)
