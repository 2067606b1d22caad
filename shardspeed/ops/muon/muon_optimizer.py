"""``MuonWithAuxAdam``: Muon for the hidden weight matrices, AdamW for every other parameter.

Each parameter group says which it is with ``use_muon`` (DeepSpeed's and Keller Jordan's
interface). A Muon group's update is ``torch.optim.Muon``'s: the momentum buffer
``B <- lerp(B, g, 1 - momentum)``, the Nesterov blend ``lerp(g, B, momentum)``, Newton-Schulz
orthogonalisation of that matrix (:mod:`.newton_schulz`), decoupled weight decay and the learning
rate scaled by ``sqrt(max(1, rows / cols))``. An AdamW group's is ``torch.optim.AdamW``'s (torch's
own functional Adam with decoupled weight decay runs it), state ``step``/``exp_avg``/
``exp_avg_sq``.

Under ZeRO stages 1-3 the optimizer steps flat chunks, not matrices: the strategy describes each
chunk with a :class:`~.layout.ShardedMatrices` (:meth:`MuonWithAuxAdam.bind_matrix_layouts`). The
momentum is element-wise and stays in the chunk; the orthogonalisation gathers the momentum
update of the whole buffer and then either every rank orthogonalises the matrices its chunk
overlaps (``ns_placement="gather"``) or each matrix is orthogonalised once, by the rank it was
dealt to, and a reduce-scatter hands every rank its chunk of the result (``"round_robin"``, the
default: no matrix is orthogonalised twice, at the cost of one more collective). The
deal goes over every matrix of every chunk (a model whose biases sit between its matrices has a
bucket, so a chunk, per matrix), each to the least loaded rank by Newton-Schulz cost
(``rows * cols * min(rows, cols)``), in the same order on every rank. Either way every element
gets exactly the value an unsharded step gives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.optim.adam import adam

from shardspeed.ops.muon.layout import MatrixSpan, ShardedMatrices
from shardspeed.ops.muon.newton_schulz import (
    MAX_NS_STEPS,
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    STACK_ELEMENTS,
    adjusted_lr,
    as_matrix,
    matrix_shape,
    orthogonalize_many,
)

#: a Muon group's settings and their defaults (DeepSpeed's MuonWithAuxAdam: lr 0.02, momentum
#: 0.95, no weight decay; the Newton-Schulz knobs are torch.optim.Muon's)
MUON_DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "momentum": 0.95,
    "weight_decay": 0.0,
    "nesterov": True,
    "ns_steps": NS_STEPS,
    "ns_coefficients": NS_COEFFICIENTS,
    "ns_eps": NS_EPS,
}
#: an AdamW group's settings and their defaults (DeepSpeed's MuonWithAuxAdam)
ADAM_DEFAULTS: dict[str, Any] = {
    "lr": 3e-4,
    "betas": (0.9, 0.95),
    "eps": 1e-10,
    "weight_decay": 0.0,
}
_T = TypeVar("_T")

#: how a sharded Muon step orthogonalises (see the module docstring)
NS_PLACEMENTS = ("gather", "round_robin")


def check_muon_settings(settings: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming the key for a Muon setting out of range; ``where`` says
    where it came from (``optimizer.params``)."""
    steps = settings.get("ns_steps", NS_STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < MAX_NS_STEPS:
        raise ValueError(
            f"{where}.ns_steps must be an integer from 1 to {MAX_NS_STEPS - 1} (Newton-Schulz "
            f"iterations), got {steps!r}"
        )
    momentum = settings.get("momentum", MUON_DEFAULTS["momentum"])
    if not 0.0 <= float(momentum) < 1.0:
        raise ValueError(f"{where}.momentum must be in [0, 1), got {momentum!r}")
    for key in ("lr", "weight_decay", "ns_eps"):
        if key in settings and float(settings[key]) < 0.0:
            raise ValueError(f"{where}.{key} must be >= 0, got {settings[key]!r}")
    coefficients = settings.get("ns_coefficients", NS_COEFFICIENTS)
    if len(tuple(coefficients)) != 3:
        raise ValueError(
            f"{where}.ns_coefficients must be three numbers (a, b, c), got {coefficients!r}"
        )


def _completed(group: dict[str, Any], index: int) -> dict[str, Any]:
    if "use_muon" not in group:
        raise ValueError(
            f"param_groups[{index}] has no 'use_muon' flag; MuonWithAuxAdam needs every group "
            "to say whether Muon (True) or AdamW (False) steps it"
        )
    defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
    allowed = {"params", "use_muon", *defaults}
    for key in group:
        if key not in allowed:
            kind = "Muon" if group["use_muon"] else "AdamW"
            raise ValueError(
                f"param_groups[{index}] ({kind}) has an unknown setting {key!r}; valid: "
                f"{', '.join(sorted(allowed - {'params'}))}"
            )
    completed = {**defaults, **group}
    if group["use_muon"]:
        check_muon_settings(completed, f"param_groups[{index}]")
        completed["ns_coefficients"] = tuple(completed["ns_coefficients"])
    else:
        completed["betas"] = tuple(completed["betas"])
    return completed


def _windows(items: list[_T], size: Callable[[_T], int]) -> Iterator[list[_T]]:
    """``items`` in consecutive runs of about :data:`STACK_ELEMENTS` elements (by ``size``)."""
    window: list[_T] = []
    held = 0
    for item in items:
        window.append(item)
        held += size(item)
        if held >= STACK_ELEMENTS:
            yield window
            window, held = [], 0
    if window:
        yield window


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon=True``, AdamW on the others (module docstring)."""

    def __init__(
        self, param_groups: Iterable[dict[str, Any]], ns_placement: str = "round_robin"
    ) -> None:
        if ns_placement not in NS_PLACEMENTS:
            raise ValueError(
                f"ns_placement must be one of {', '.join(NS_PLACEMENTS)}, got {ns_placement!r}"
            )
        groups = [_completed(dict(g), i) for i, g in enumerate(param_groups)]
        super().__init__(groups, {})
        self.ns_placement = ns_placement
        #: stepped tensor id -> how it holds pieces of matrices (ZeRO stages 1-3)
        self._layouts: dict[int, ShardedMatrices] = {}
        #: (stepped tensor id, matrix index) -> the rank that orthogonalises it (round_robin)
        self._owners: dict[tuple[int, int], int] = {}
        for group in self.param_groups:
            for p in group["params"] if group["use_muon"] else ():
                if p.dim() < 2:
                    raise ValueError(
                        f"a Muon group holds a tensor of shape {tuple(p.shape)}; Muon steps "
                        "matrices (2-D or more): put it in a use_muon=False group"
                    )

    def bind_matrix_layouts(self, layouts: Mapping[int, ShardedMatrices]) -> None:
        """The ZeRO strategy replaced the Muon groups' matrices with flat chunks: ``layouts``
        (by stepped tensor id) says which matrices each chunk holds pieces of."""
        self._layouts = dict(layouts)
        self._owners = self._deal_matrices()
        for group in self.param_groups:
            for p in group["params"] if group["use_muon"] else ():
                if p.dim() < 2 and id(p) not in self._layouts:
                    raise ValueError(
                        f"a Muon group steps a flat tensor of {p.numel()} elements with no "
                        "matrix layout; the strategy must describe every chunk it rebinds"
                    )

    def _deal_matrices(self) -> dict[tuple[int, int], int]:
        """Each sharded matrix's orthogonalising rank: to the least loaded, by cost, in
        parameter-group order (the same deal on every rank)."""
        owners: dict[tuple[int, int], int] = {}
        loads: dict[int, list[int]] = {}  # per world size (expert groups have their own)
        for group in self.param_groups:
            for p in group["params"] if group["use_muon"] else ():
                layout = self._layouts.get(id(p))
                if layout is None:
                    continue
                load = loads.setdefault(layout.world_size, [0] * layout.world_size)
                for index, span in enumerate(layout.matrices):
                    rows, cols = matrix_shape(span.shape)
                    rank = min(range(layout.world_size), key=lambda r: (load[r], r))
                    load[rank] += rows * cols * min(rows, cols)
                    owners[(id(p), index)] = rank
        return owners

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]  # torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adam_group(group)
        return loss

    # -- Muon -------------------------------------------------------------------------------
    def _momentum(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance ``p``'s momentum buffer; the update to orthogonalise (element-wise)."""
        assert p.grad is not None
        grad = p.grad
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _orthogonal(
        self, matrices: list[torch.Tensor], group: dict[str, Any]
    ) -> list[torch.Tensor]:
        return orthogonalize_many(
            matrices, group["ns_coefficients"], group["ns_steps"], group["ns_eps"]
        )

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        stepped = [p for p in group["params"] if p.grad is not None]
        whole = [p for p in stepped if id(p) not in self._layouts]  # stage 0, or no ZeRO
        # a window at a time (bounded extra memory): the momentum updates, then the window's
        # matrices orthogonalised together, the same-shaped ones batched
        for window in _windows(whole, lambda p: p.numel()):
            updates = [as_matrix(self._momentum(p, group)) for p in window]
            for p, ortho in zip(window, self._orthogonal(updates, group), strict=True):
                p.mul_(1 - lr * decay)
                p.add_(ortho.view_as(p), alpha=-adjusted_lr(lr, matrix_shape(p.shape)))
        sharded = [p for p in stepped if id(p) in self._layouts]
        for window in _windows(sharded, lambda p: self._layouts[id(p)].full_numel):
            items = [(p, self._momentum(p, group), self._layouts[id(p)]) for p in window]
            self._sharded_muon(items, group)

    def _sharded_muon(
        self, items: list[tuple[torch.Tensor, torch.Tensor, ShardedMatrices]], group: dict[str, Any]
    ) -> None:
        """One Muon step of these chunks (collectives: every rank of a layout calls this for the
        same tensors in the same order). Each chunk's whole buffer is gathered (not at one
        rank: the chunk is the buffer), the matrices this rank orthogonalises are done in one
        batch, then each chunk takes its pieces (``round_robin``: by a reduce-scatter)."""
        fulls = [
            update if layout.world_size == 1 else layout.gather(update)
            for _, update, layout in items
        ]
        dealt = [
            self.ns_placement == "round_robin" and layout.world_size > 1 for _, _, layout in items
        ]
        #: per chunk, the matrices with elements in it and their flat ranges (computed once)
        mines = [layout.mine() for _, _, layout in items]
        jobs: list[tuple[int, MatrixSpan]] = []
        for i, (chunk, _, layout) in enumerate(items):
            if dealt[i]:
                owned = [
                    span
                    for index, span in enumerate(layout.matrices)
                    if self._owners[(id(chunk), index)] == layout.rank
                ]
            else:
                owned = [span for span, _, _ in mines[i]]
            jobs += [(i, span) for span in owned]
        results = self._orthogonal(
            [
                fulls[i][span.offset : span.offset + span.numel].view(matrix_shape(span.shape))
                for i, span in jobs
            ],
            group,
        )
        done = {(i, span): r.reshape(-1) for (i, span), r in zip(jobs, results, strict=True)}
        lr = group["lr"]
        for i, (chunk, _, layout) in enumerate(items):
            start = layout.chunk_start
            if dealt[i]:
                out = torch.zeros(layout.full_numel, dtype=torch.float32, device=fulls[i].device)
                for span in layout.matrices:
                    if (i, span) in done:
                        out[span.offset : span.offset + span.numel] = done[(i, span)]
                # every element but the owner's is zero: the sum is the owner's value, exactly
                mine = layout.reduce_scatter(out)
                pieces = [mine[lo - start : hi - start] for _, lo, hi in mines[i]]
            else:
                pieces = [
                    done[(i, span)][lo - span.offset : hi - span.offset]
                    for span, lo, hi in mines[i]
                ]
            chunk.mul_(1 - lr * group["weight_decay"])
            for values, (span, lo, hi) in zip(pieces, mines[i], strict=True):
                scale = adjusted_lr(lr, matrix_shape(span.shape))
                chunk[lo - start : hi - start].add_(values.to(chunk.device), alpha=-scale)

    # -- AdamW ------------------------------------------------------------------------------
    def _adam_group(self, group: dict[str, Any]) -> None:
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                # torch's AdamW state, so checkpoints and state inspection read the same keys
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            avgs,
            sqs,
            [],
            steps,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
