"""Weights shared across pipeline stages (:class:`~.layer_spec.TiedLayerSpec`): one process
group per tie, the initial broadcast that makes every stage's copy equal, and the gradient sum
over the stages that hold a tie."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.comm.mesh import groups_for
from shardspeed.runtime.pipe.layer_spec import TiedLayerSpec

if TYPE_CHECKING:
    from shardspeed.runtime.pipe.module import PipelineModule


@dataclass
class Tie:
    """One tied key as this rank holds it."""

    key: str
    #: global ranks of the stages holding the key, at this rank's other coordinates
    ranks: list[int]
    group: Any
    module: nn.Module
    weight_attr: list[str]

    def weights(self) -> list[torch.Tensor]:
        """The tied tensors (``tied_weight_attr`` may be dotted: ``"word_embeddings.weight"``)."""
        found = []
        for attr in self.weight_attr:
            owner: Any = self.module
            for part in attr.split("."):
                owner = getattr(owner, part)
            found.append(owner)
        return found

    @property
    def owner(self) -> bool:
        """Whether this rank is the tie's first stage (the one that counts it in the norm)."""
        return comm.get_rank() == self.ranks[0]


class TiedWeights:
    """The ties of a :class:`~.module.PipelineModule` that span more than one stage."""

    def __init__(self, module: PipelineModule) -> None:
        topo = module.topology()
        stages_of: dict[str, list[int]] = {}
        for index, spec in enumerate(module._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                stage = module.stage_owner(index)
                held = stages_of.setdefault(spec.key, [])
                if stage not in held:
                    held.append(stage)
        me = topo.get_coord(comm.get_rank())._asdict()
        self.ties: list[Tie] = []
        for key, stages in stages_of.items():  # the same order on every rank
            if len(stages) < 2:
                continue
            # one group per position on the other axes; every rank creates every group
            others = [a for a in topo.get_axis_names() if a != "pipe"]
            classes: dict[tuple[int, ...], list[int]] = {}
            for rank in range(topo.world_size()):
                coord = topo.get_coord(rank)._asdict()
                if coord["pipe"] in stages:
                    classes.setdefault(tuple(coord[a] for a in others), []).append(rank)
            group = groups_for([sorted(ranks) for _, ranks in sorted(classes.items())])
            if module.stage_id in stages:
                ranks = sorted(classes[tuple(me[a] for a in others)])
                self.ties.append(
                    Tie(key, ranks, group, module.tied_modules[key], module.tied_weight_attrs[key])
                )

    def synchronize(self) -> None:
        """Every stage starts from the first stage's copy of each tied weight."""
        for tie in self.ties:
            for weight in tie.weights():
                comm.broadcast(weight.data, src=tie.ranks[0], group=tie.group)

    def allreduce_grads(self, grad_of: Any = None) -> None:
        """Sum each tied weight's gradient over its stages (``grad_of(weight)`` finds the
        gradient; default ``.grad``)."""
        for tie in self.ties:
            for weight in tie.weights():
                grad = weight.grad if grad_of is None else grad_of(weight)
                if grad is None:
                    raise RuntimeError(
                        f"tied weight {tie.key!r} has no gradient on rank {comm.get_rank()}: "
                        "every stage holding a TiedLayerSpec must use it in its forward"
                    )
                comm.all_reduce(grad, group=tie.group)

    def duplicates(self) -> list[torch.Tensor]:
        """Tied weights this rank holds a copy of but does not count (not the first stage)."""
        return [w for tie in self.ties if not tie.owner for w in tie.weights()]

    def weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return [(w, tie.group) for tie in self.ties for w in tie.weights()]

    def as_comms(self) -> dict[str, dict[str, Any]]:
        return {
            tie.key: {
                "ranks": tie.ranks,
                "group": tie.group,
                "weight_attr": tie.weight_attr,
                "module": tie.module,
            }
            for tie in self.ties
        }
