"""Per-block Hessian eigenvalues by power iteration (DeepSpeed's ``eigenvalue`` section).

For each of the first ``layer_num`` blocks of the layer list at ``layer_name`` (a dotted path
from the model, e.g. ``bert.encoder.layer``), :meth:`Eigenvalue.compute_eigenvalue` estimates the
largest-magnitude eigenvalue of the Hessian of the loss with respect to that block's parameters.
Each power-iteration step is one Hessian-vector product: the gradient of ``<grad, v>``, taken
through the gradients' own graph. Called directly (DeepSpeed's way), those are the ``.grad``
that ``loss.backward(create_graph=True)`` left. In the engine, :meth:`Eigenvalue.collect` takes
them with ``torch.autograd.grad(create_graph=True)`` before each backward of a window whose
boundary computes (the ZeRO gradient buffers copy ``.grad`` in place, which would cut the
graph); the engine's backward then retains its graph, and :meth:`Eigenvalue.at_boundary`
measures before the optimizer step and frees them.

What it returns is DeepSpeed's: ``{id(param): (value, block index)}`` for every parameter of
each measured block, where the values are the block estimates' magnitudes divided by the largest
one (so in ``(0, 1]``) and a block whose estimate is 0 (or not finite) reads 1.0. The raw signed
estimates and the iteration counts of the last call are kept in :attr:`Eigenvalue.raw_eigenvalues`
and :attr:`Eigenvalue.iterations`; the monitor events carry the normalised values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardspeed.config.eigenvalue import EigenvalueConfig
from shardspeed.utils.logging import log_dist

__all__ = ["EIGENVALUE_EVENT", "Eigenvalue", "EigenvalueConfigError"]

#: the monitor tag of block ``i``'s (normalised) eigenvalue
EIGENVALUE_EVENT = "Train/Eigenvalues/ModelBlockParam_{}"

#: the power iteration's start vector comes from its own generator with this seed, so that the
#: global RNG (dropout, data order) is left as it was and every call starts the same way
_START_SEED = 0


class EigenvalueConfigError(ValueError, AssertionError):
    """An ``eigenvalue`` setting that cannot name the blocks to measure (DeepSpeed asserts)."""


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with NaN and +-inf replaced by 0 (a half-precision overflow must not poison
    the iteration)."""
    return torch.nan_to_num(tensor, nan=0.0, posinf=0.0, neginf=0.0)


def _dot(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> float:
    """The inner product of two vectors stored as lists of tensors."""
    return float(sum(torch.sum(x.float() * y.float()) for x, y in zip(xs, ys, strict=True)))


class Eigenvalue:
    """Power iteration over the Hessian of each measured block (see the module docstring)."""

    def __init__(
        self,
        verbose: bool = False,
        max_iter: int = 100,
        tol: float = 1e-2,
        stability: float = 0.0,
        gas_boundary_resolution: int = 1,
        layer_name: str = "",
        layer_num: int = 0,
    ) -> None:
        if not layer_name or layer_num <= 0:
            raise EigenvalueConfigError(
                "eigenvalue needs the blocks to measure: set eigenvalue.layer_name to the dotted "
                "path of the model's layer list (e.g. 'bert.encoder.layer') and "
                f"eigenvalue.layer_num to how many of them (got layer_name={layer_name!r}, "
                f"layer_num={layer_num})"
            )
        if max_iter <= 0 or tol <= 0 or stability < 0 or gas_boundary_resolution <= 0:
            raise EigenvalueConfigError(
                "eigenvalue needs max_iter > 0, tol > 0, stability >= 0 and "
                f"gas_boundary_resolution > 0 (got max_iter={max_iter}, tol={tol}, "
                f"stability={stability}, gas_boundary_resolution={gas_boundary_resolution})"
            )
        self.verbose = verbose
        self.max_iter = max_iter
        self.tol = tol
        self.stability = stability
        self.gas_boundary_resolution = gas_boundary_resolution
        self.layer_name = layer_name
        self.layer_num = layer_num
        #: the signed estimate of each block at the last :meth:`compute_eigenvalue`
        self.raw_eigenvalues: list[float] = []
        #: the power-iteration steps each block took at the last :meth:`compute_eigenvalue`
        self.iterations: list[int] = []
        #: accumulation boundaries seen by :meth:`at_boundary`
        self.gas_boundary_ctr = 0
        self._pending: list[float] = []
        #: gradients with their graph, summed over this accumulation window (see :meth:`collect`)
        self._grads: dict[torch.Tensor, torch.Tensor] = {}
        self._warned = False
        log_dist(
            f"eigenvalue enabled: verbose={verbose}, max_iter={max_iter}, tol={tol}, "
            f"stability={stability}, gas_boundary_resolution={gas_boundary_resolution}, "
            f"layer_name={layer_name}, layer_num={layer_num}",
            ranks=[0],
        )

    @classmethod
    def from_config(cls, config: EigenvalueConfig) -> Eigenvalue | None:
        """The estimator the ``eigenvalue`` section asks for; None when it is not enabled."""
        if not config.enabled:
            return None
        return cls(
            verbose=config.verbose,
            max_iter=config.max_iter,
            tol=config.tol,
            stability=config.stability,
            gas_boundary_resolution=config.gas_boundary_resolution,
            layer_name=config.layer_name,
            layer_num=config.layer_num,
        )

    # -- the estimate ---------------------------------------------------------------------------
    def get_layers(self, module: nn.Module) -> Any:
        """The layer list at :attr:`layer_name` inside ``module``."""
        found: Any = module
        for name in self.layer_name.split("."):
            if not hasattr(found, name):
                raise EigenvalueConfigError(
                    f"eigenvalue.layer_name={self.layer_name!r}: {type(found).__name__} has no "
                    f"attribute {name!r}; name the dotted path of the model's layer list"
                )
            found = getattr(found, name)
        if len(found) < self.layer_num:
            raise EigenvalueConfigError(
                f"eigenvalue.layer_num={self.layer_num} but {self.layer_name!r} holds "
                f"{len(found)} layers; set layer_num to at most {len(found)}"
            )
        return found

    def normalize(self, vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``vectors`` divided by their joint norm plus :attr:`stability` (a zero vector stays
        zero, not NaN)."""
        norm = math.sqrt(max(_dot(vectors, vectors), 0.0)) + self.stability
        return [_finite(v / norm) for v in vectors]

    def _converged(self, current: float, previous: float, steps: int) -> bool:
        if steps >= self.max_iter or current == 0.0:
            return True
        return abs((current - previous) / current) < self.tol

    def _graph_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s gradient with its graph: the one :meth:`collect` kept, else ``.grad`` when
        a ``backward(create_graph=True)`` left one with a graph."""
        kept = self._grads.get(param)
        if kept is not None:
            return kept
        grad = param.grad
        return grad if grad is not None and grad.grad_fn is not None else None

    def _block_eigenvalue(
        self, block: nn.Module, device: torch.device | str | None, scale: float
    ) -> tuple[float, int] | None:
        """(signed estimate, steps) for one block; None when no parameter of it carries a
        gradient graph (the backward did not run with ``create_graph``, or the block was unused)."""
        pairs = [(p, self._graph_grad(p)) for p in block.parameters()]
        params = [p for p, g in pairs if g is not None]
        grads = [g for _, g in pairs if g is not None]
        if not params:
            return None
        generator = torch.Generator().manual_seed(_START_SEED)
        start = [torch.randn(p.shape, generator=generator) for p in params]
        v = self.normalize(
            [
                s.to(p.device if device is None else device)
                for s, p in zip(start, params, strict=True)
            ]
        )
        current, previous, steps = 1.0, 0.0, 0
        while not self._converged(current, previous, steps):
            previous = current
            hv = torch.autograd.grad(
                grads,
                params,
                grad_outputs=[x.to(g.dtype) for x, g in zip(v, grads, strict=True)],
                retain_graph=True,
                allow_unused=True,
            )
            # the gradients are of the loss times ``scale`` (fp16 loss scaling): so is H v
            hv_list = [
                torch.zeros_like(p, dtype=torch.float32)
                if h is None
                else _finite(h).float() / scale
                for h, p in zip(hv, params, strict=True)
            ]
            current = _dot(hv_list, v)
            if not math.isfinite(current):
                current = 0.0
            v = self.normalize(hv_list)
            steps += 1
        return current, steps

    def compute_eigenvalue(
        self, module: nn.Module, device: torch.device | str | None = None, scale: float = 1.0
    ) -> dict[int, tuple[float, int]]:
        """``{id(param): (normalised eigenvalue, block index)}`` for the measured blocks of
        ``module``, from the gradients its last backward left (with ``create_graph=True``);
        ``scale`` is the loss scale those gradients carry. Empty (with a warning) when no block
        has a gradient graph to differentiate."""
        layers = self.get_layers(module)
        raw: list[float] = []
        steps: list[int] = []
        for index in range(self.layer_num):
            found = self._block_eigenvalue(layers[index], device, float(scale))
            value, count = found if found is not None else (0.0, 0)
            raw.append(value)
            steps.append(count)
            if self.verbose:
                log_dist(
                    f"block: {index}, power iteration: {count}, eigenvalue: {value}", ranks=[0]
                )
        self.raw_eigenvalues, self.iterations = raw, steps
        if all(count == 0 for count in steps):
            if not self._warned:
                self._warned = True
                log_dist(
                    "eigenvalue: no measured block has a gradient with a graph to differentiate "
                    "(train through engine.backward() with the eigenvalue section enabled, or "
                    "call loss.backward(create_graph=True) first); no eigenvalues computed",
                    ranks=[0],
                    level=logging.WARNING,
                )
            return {}
        values = self.post_process(raw)
        if self.verbose:
            log_dist(f"post processed block eigenvalues: {values}", ranks=[0])
        result: dict[int, tuple[float, int]] = {}
        for index, value in enumerate(values):
            for p in layers[index].parameters():
                result[id(p)] = (value, index)
        return result

    @staticmethod
    def post_process(values: Sequence[float]) -> list[float]:
        """Magnitudes divided by the largest; a 0 or non-finite estimate (a block that gave no
        valid value, e.g. in fp16) becomes 1.0 as in DeepSpeed."""
        clean = [abs(v) if math.isfinite(v) else 0.0 for v in values]
        largest = max(clean, default=0.0)
        return [v / largest if v != 0.0 else 1.0 for v in clean]

    # -- the engine's hooks ---------------------------------------------------------------------
    def collect(self, module: nn.Module, scaled_loss: torch.Tensor) -> bool:
        """Called by the engine before each backward: in a window whose boundary will compute,
        add the measured blocks' gradients of ``scaled_loss``, with their graph, to the ones kept
        for :meth:`at_boundary`. They are taken apart from ``.grad`` because the ZeRO gradient
        buffers copy ``.grad`` in place, which would cut the graph. Returns whether the backward
        must retain its graph (the kept gradients need it)."""
        if (self.gas_boundary_ctr + 1) % self.gas_boundary_resolution != 0:
            return False
        layers = self.get_layers(module)
        params = [
            p
            for index in range(self.layer_num)
            for p in layers[index].parameters()
            if p.requires_grad
        ]
        if not params:
            return False
        grads = torch.autograd.grad(
            scaled_loss, params, create_graph=True, retain_graph=True, allow_unused=True
        )
        for param, grad in zip(params, grads, strict=True):
            if grad is not None:
                kept = self._grads.get(param)
                self._grads[param] = grad if kept is None else kept + grad
        return True

    def at_boundary(
        self, module: nn.Module, device: torch.device | str | None, scale: float
    ) -> dict[int, tuple[float, int]] | None:
        """Called at every accumulation boundary before the optimizer step: the block
        eigenvalues at every ``gas_boundary_resolution``-th boundary, else None."""
        self.gas_boundary_ctr += 1
        self._pending = []
        if self.gas_boundary_ctr % self.gas_boundary_resolution != 0:
            return None
        log_dist("computing eigenvalue...", ranks=[0])
        try:
            result = self.compute_eigenvalue(module, device, scale)
        finally:
            self._grads = {}  # frees the window's graphs
        if result:
            by_block = {index: value for value, index in result.values()}
            self._pending = [by_block[i] for i in sorted(by_block)]
        return result

    def events(self, global_samples: int) -> list[tuple[str, float, int]]:
        """The monitor events of the last :meth:`at_boundary` (one per block), then none."""
        pending, self._pending = self._pending, []
        return [(EIGENVALUE_EVENT.format(i), v, global_samples) for i, v in enumerate(pending)]
