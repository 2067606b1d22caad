"""Compute over tiles of the sequence: DeepSpeed's ``SequenceTiledCompute``,
``sequence_tiled_compute``, ``TiledMLP`` and ``TiledFusedLogitsLoss`` (ALST, arXiv 2506.13996).

A long sequence's MLP or loss does not need its activations for the whole sequence at once:
each of these runs ``fn`` on one tile (a slice along the sequence) at a time, keeps only the
tile's output, and in backward runs the tile again with gradients on. Peak memory is one
tile's intermediates (for the loss: one tile's logits instead of ``[tokens, vocab]``).

How gradients reach the parameters ``fn`` uses: each tile's backward asks autograd for the
gradients of the tile's input and of every trainable leaf in the tile's graph
(:func:`torch.autograd.grad`, nothing accumulates into ``.grad``), the tiles' parameter
gradients are summed, and the sums are handed to autograd once at the end
(:class:`_ParamGrads`). So each parameter's gradient arrives once per backward, as it does
without tiling, and whatever hooks the engine keeps on gradient arrival (ZeRO's bucketed
reduction, stage 3's release of a module's parameters after their gradients arrived) works
unchanged. DeepSpeed instead lets every tile accumulate into ``.grad`` and sets
``param.ds_grad_is_ready = False`` on ``compute_params`` for all but the last tile, so its
stage 3 skips the reduction until then; here no flag is needed and the parameters need not be
listed.

``compute_params`` here means what it does for ZeRO-3 in DeepSpeed: the parameters ``fn``
uses. They are gathered once around all tiles of a pass (one all-gather for the forward's
tiles and one for the backward's, instead of one per tile) with :class:`GatheredParameters`,
which holds them gathered while the module hooks inside the tiles run; not partitioned
parameters pass through untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "sequence_tiled_compute",
    "tile_bounds",
]

#: the label value a loss ignores (PyTorch's and Hugging Face's ``ignore_index``)
IGNORE_INDEX = -100
_REDUCTIONS = (None, "mean", "sum")


def _check_shards(shards: Any) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int):
        raise TypeError(f"shards must be an int >= 1, got {shards!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return shards


def tile_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each tile of ``length`` items cut into ``shards`` tiles: tiles of
    ``ceil(length / shards)``, the last one shorter, none empty (:func:`torch.chunk`'s cut, so
    there may be fewer than ``shards`` tiles; an empty input is one empty tile)."""
    _check_shards(shards)
    if length <= 0:
        return [(0, 0)]
    step = math.ceil(length / shards)
    return [(start, min(step, length - start)) for start in range(0, length, step)]


@contextmanager
def _gathered(params: Sequence[Tensor] | None) -> Iterator[None]:
    """ZeRO-3 ``params`` gathered (and held) inside the block; a no-op for plain tensors."""
    if not params:
        yield
        return
    # imported here: ZeRO is a sibling package and most callers never tile under it
    from shardspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(list(params)):
        yield


def _trainable_leaves(roots: Sequence[Tensor], exclude: Sequence[Tensor]) -> list[Tensor]:
    """The leaf tensors that require grad in the autograd graph of ``roots`` (the parameters
    a tile's ``fn`` used), except ``exclude``."""
    skip = {id(t) for t in exclude}
    leaves: dict[int, Tensor] = {}
    for root in roots:
        if root.requires_grad and root.grad_fn is None and id(root) not in skip:
            leaves[id(root)] = root
    visited: list[Any] = []  # referenced so that ids are not reused while walking
    seen: set[int] = set()
    stack: list[Any] = [root.grad_fn for root in roots if root.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node holds its leaf
        if isinstance(leaf, Tensor):
            if id(leaf) not in skip:
                leaves[id(leaf)] = leaf
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


class _ParamGrads:
    """Gradients of the parameters the tiles used, summed over the tiles and handed to
    autograd once (see the module's docstring)."""

    def __init__(self) -> None:
        self.params: dict[int, Tensor] = {}
        self.sums: dict[int, Tensor] = {}

    def tile_backward(
        self, output: Tensor, grad_output: Tensor, inputs: Sequence[Tensor]
    ) -> list[Tensor | None]:
        """Backward of one tile: returns the gradients of ``inputs``, keeps those of the
        trainable leaves the tile's graph reaches."""
        if not output.requires_grad:
            return [None] * len(inputs)
        params = _trainable_leaves([output], inputs)
        targets = [*inputs, *params]
        grads = torch.autograd.grad(output, targets, grad_output, allow_unused=True)
        for param, grad in zip(params, grads[len(inputs) :], strict=True):
            if grad is None:
                continue
            key = id(param)
            self.params[key] = param
            # out of place: autograd may hand back an expanded view
            self.sums[key] = grad if key not in self.sums else self.sums[key] + grad
        return list(grads[: len(inputs)])

    def param_list(self) -> list[Tensor]:
        return [self.params[k] for k in self.sums]

    def scaled(self, scale: Tensor | None) -> list[Tensor]:
        """The sums (times ``scale``, kept in each gradient's dtype), in :meth:`param_list`'s
        order."""
        if scale is None:
            return list(self.sums.values())
        return [s * scale.to(dtype=s.dtype, device=s.device) for s in self.sums.values()]

    def deliver(self) -> None:
        """Accumulate the sums into the parameters' ``.grad``, one arrival per parameter,
        through autograd so that gradient hooks run (a backward nested in the running one)."""
        if self.sums:
            torch.autograd.backward(self.param_list(), self.scaled(None))


#: False while an autograd function runs on an input :func:`_anchor` made to require grad
_INPUT_GRAD_WANTED: ContextVar[bool] = ContextVar("_INPUT_GRAD_WANTED", default=True)


def _anchor(x: Any, params: Iterable[Any]) -> tuple[Any, bool]:
    """``x`` and whether its gradient is wanted. When ``x`` needs no gradient but some of
    ``params`` do (a trainable layer over frozen inputs), a detached ``x`` that requires grad
    is returned instead, so that the autograd function's backward runs and trains them."""
    if not isinstance(x, Tensor) or x.requires_grad or not torch.is_grad_enabled():
        return x, True
    if any(isinstance(p, Tensor) and p.requires_grad for p in params):
        return x.detach().requires_grad_(), False
    return x, True


def _params_of(*holders: Any) -> list[Tensor]:
    """The parameters of the modules among ``holders`` and the tensors in the sequences."""
    found: list[Tensor] = []
    for holder in holders:
        if isinstance(holder, torch.nn.Module):
            found.extend(holder.parameters())
        elif isinstance(holder, (list, tuple)):
            found.extend(t for t in holder if isinstance(t, Tensor))
    return found


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def _tile(tensor: Tensor, dim: int, start: int, size: int, requires_grad: bool) -> Tensor:
    piece = tensor.detach().narrow(dim, start, size)
    return piece.requires_grad_(requires_grad) if requires_grad else piece


def _reduce(output: Tensor, reduction: str | None) -> Tensor:
    if reduction == "mean":
        return output.mean()
    if reduction == "sum":
        return output.sum()
    return output


class SequenceTiledCompute(torch.autograd.Function):
    """``fn(**kwargs)`` computed tile by tile along dimension 1 of the ``kwargs_to_shard``
    tensors, with its output joined (and reduced) as if computed whole. Use it through
    :func:`sequence_tiled_compute` (an autograd function takes no dicts).

    ``fn`` runs once per tile in forward (without gradients) and once more per tile in
    backward. Gradients flow to the ``grad_requiring_tensor_key`` input and to the trainable
    parameters ``fn`` uses; the other inputs get none (as in DeepSpeed).
    """

    @staticmethod
    def forward(  # type: ignore[override]  # autograd's signature is variadic
        ctx: Any,
        fn: Callable[..., Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Sequence[Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> Tensor:
        if output_reduction not in _REDUCTIONS:
            raise ValueError(
                f"unknown output_reduction {output_reduction!r}: valid values are None, "
                '"mean" and "sum"'
            )
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(
                f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} must be one of the "
                f"kwargs_to_shard keys {list(keys_to_shard)}"
            )
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError("one value per kwargs_to_shard and kwargs_to_pass key is needed")
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)], strict=True))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard) :], strict=True))
        for key, value in sharded.items():
            if not isinstance(value, Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"kwargs_to_shard[{key!r}] must be a tensor of shape [batch, seqlen={seqlen}, "
                    f"...], got {shape}"
                )
        bounds = tile_bounds(seqlen, shards)
        with _gathered(compute_params):
            outputs = [
                fn(**{k: v.narrow(1, start, size) for k, v in sharded.items()}, **passed)
                for start, size in bounds
            ]
        if output_unshard_dimension == 0:
            # one output per tile (the loss case): stacked on a new first dimension
            joined = torch.cat([out.unsqueeze(0) for out in outputs], dim=0)
        else:
            joined = torch.cat(outputs, dim=output_unshard_dimension)
        ctx.fn, ctx.bounds = fn, bounds
        ctx.input_grad_wanted = _INPUT_GRAD_WANTED.get()
        ctx.keys_to_shard, ctx.keys_to_pass = list(keys_to_shard), list(keys_to_pass)
        ctx.grad_key = grad_requiring_tensor_key
        ctx.compute_params = compute_params
        ctx.dim, ctx.reduction = output_unshard_dimension, output_reduction
        ctx.out_sizes = [1 if ctx.dim == 0 else out.shape[ctx.dim] for out in outputs]
        ctx.total = joined.numel()
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.others = [None if isinstance(a, Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        return _reduce(joined, output_reduction)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        args = list(ctx.others)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            args[position] = tensor
        n_shard = len(ctx.keys_to_shard)
        sharded = dict(zip(ctx.keys_to_shard, args[:n_shard], strict=True))
        passed = {k: _detached(v) for k, v in zip(ctx.keys_to_pass, args[n_shard:], strict=True)}
        grad_index = ctx.keys_to_shard.index(ctx.grad_key)
        wants_input_grad = ctx.needs_input_grad[9 + grad_index] and ctx.input_grad_wanted
        target = sharded[ctx.grad_key]
        input_grad = torch.zeros_like(target) if wants_input_grad else None
        grad_output = grads[0]
        param_grads = _ParamGrads()
        offset = 0
        with _gathered(ctx.compute_params):
            for index, ((start, size), out_size) in enumerate(
                zip(ctx.bounds, ctx.out_sizes, strict=True)
            ):
                tile = {
                    k: _tile(v, 1, start, size, wants_input_grad and k == ctx.grad_key)
                    for k, v in sharded.items()
                }
                with torch.enable_grad():
                    output = ctx.fn(**tile, **passed)
                tile_grad = _tile_grad(ctx, grad_output, output, index, offset, out_size)
                offset += out_size
                inputs = [tile[ctx.grad_key]] if wants_input_grad else []
                got = param_grads.tile_backward(output, tile_grad, inputs)
                if input_grad is not None and got and got[0] is not None:
                    input_grad.narrow(1, start, size).copy_(got[0])
        param_grads.deliver()
        result: list[Tensor | None] = [None] * (9 + len(args))
        result[9 + grad_index] = input_grad
        return tuple(result)


def _tile_grad(
    ctx: Any, grad_output: Tensor, output: Tensor, index: int, offset: int, size: int
) -> Tensor:
    """The gradient of one tile's output, from the gradient of the joined, reduced one."""
    if ctx.reduction == "sum":
        return grad_output.expand_as(output)
    if ctx.reduction == "mean":
        # d mean / d element = 1 / (elements of the joined output), whatever the tiles' sizes
        return (grad_output / ctx.total).expand_as(output)
    if ctx.dim == 0:
        return grad_output[index]
    return grad_output.narrow(ctx.dim, offset, size)


def sequence_tiled_compute(
    fn: Callable[..., Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, Any],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> Tensor:
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` computed over ``shards`` tiles of the
    sequence (dimension 1, of length ``seqlen``, of every ``kwargs_to_shard`` tensor).

    The tiles' outputs are joined along ``output_unshard_dimension`` (0: one output per tile,
    stacked, the loss case) and reduced by ``output_reduction``: ``None`` (the joined
    output), ``"mean"`` or ``"sum"`` over all its elements. With dimension 0 and ``"mean"``
    that is the plain mean of the tiles' outputs (DeepSpeed's behaviour): for a mean over
    tokens that is exact only when every tile holds as many counted tokens; otherwise have
    ``fn`` return its tile's loss sum divided by the whole sequence's token count and use
    ``"sum"`` (or use :class:`TiledFusedLogitsLoss`, which weights the tiles itself).

    ``grad_requiring_tensor_key`` names the sharded input that gets a gradient;
    ``compute_params`` are the parameters ``fn`` uses (ZeRO-3 gathers them once per pass).
    Works without any engine.
    """
    to_shard = dict(kwargs_to_shard)
    wanted = True
    if grad_requiring_tensor_key in to_shard:
        params = _params_of(compute_params, *kwargs_to_pass.values())
        to_shard[grad_requiring_tensor_key], wanted = _anchor(
            to_shard[grad_requiring_tensor_key], params
        )
    token = _INPUT_GRAD_WANTED.set(wanted)
    try:
        return SequenceTiledCompute.apply(  # type: ignore[no-any-return]
            fn,
            seqlen,
            shards,
            list(to_shard),
            list(kwargs_to_pass),
            grad_requiring_tensor_key,
            compute_params,
            output_unshard_dimension,
            output_reduction,
            *to_shard.values(),
            *kwargs_to_pass.values(),
        )
    finally:
        _INPUT_GRAD_WANTED.reset(token)


class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` (an MLP's forward) computed over ``shards`` tiles of ``x`` along its
    sequence dimension (``-2``: ``x`` is ``[batch, seqlen, hidden]`` or ``[tokens, hidden]``),
    recomputed tile by tile in backward. ``fn`` must treat positions independently (an MLP).

    ``TiledMLP.apply(fn, self, x, shards, compute_params)``; ``compute_params`` (may be
    ``None``): the parameters ``fn`` uses, gathered once per pass under ZeRO-3. Patch e.g.
    ``LlamaMLP.forward`` to call it (shards: ``ceil(seqlen / hidden)``, agreed across ranks).

    When ``x`` needs no gradient, the parameters of ``self`` (a module) and ``compute_params``
    that need one still get it.
    """

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 5 or kwargs:
            return super().apply(*args, **kwargs)  # autograd's own error for a wrong call
        fn, module, x, shards, compute_params = args
        x, wanted = _anchor(x, _params_of(module, compute_params))
        token = _INPUT_GRAD_WANTED.set(wanted)
        try:
            return super().apply(fn, module, x, shards, compute_params)
        finally:
            _INPUT_GRAD_WANTED.reset(token)

    @staticmethod
    def forward(  # type: ignore[override]  # autograd's signature is variadic
        ctx: Any,
        fn: Callable[[Any, Tensor], Tensor],
        self: Any,
        x: Tensor,
        shards: int,
        compute_params: Sequence[Tensor] | None,
    ) -> Tensor:
        if x.dim() < 2:
            raise ValueError(f"x must be [..., seqlen, hidden], got shape {tuple(x.shape)}")
        bounds = tile_bounds(x.shape[-2], shards)
        with _gathered(compute_params):
            outputs = [fn(self, x.narrow(-2, start, size)) for start, size in bounds]
        ctx.fn, ctx.module, ctx.bounds, ctx.compute_params = fn, self, bounds, compute_params
        ctx.input_grad_wanted = _INPUT_GRAD_WANTED.get()
        ctx.save_for_backward(x)
        return torch.cat(outputs, dim=-2)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        wants_input_grad = ctx.needs_input_grad[2] and ctx.input_grad_wanted
        x_grad = torch.zeros_like(x) if wants_input_grad else None
        param_grads = _ParamGrads()
        with _gathered(ctx.compute_params):
            for start, size in ctx.bounds:
                tile = _tile(x, -2, start, size, wants_input_grad)
                with torch.enable_grad():
                    output = ctx.fn(ctx.module, tile)
                got = param_grads.tile_backward(
                    output, grads[0].narrow(-2, start, size), [tile] if wants_input_grad else []
                )
                if x_grad is not None and got and got[0] is not None:
                    x_grad.narrow(-2, start, size).copy_(got[0])
        param_grads.deliver()
        return None, None, x_grad, None, None


class _LossCall:
    """What :meth:`TiledFusedLogitsLoss.apply` tells its forward (grad mode at the call:
    inside an autograd function's forward gradients are always off) and gets back (the
    parameters' gradients)."""

    def __init__(self) -> None:
        self.grad_enabled = torch.is_grad_enabled()
        self.param_grads = _ParamGrads()


_LOSS_CALL: ContextVar[_LossCall | None] = ContextVar("_LOSS_CALL", default=None)


class _RelayParamGrads(torch.autograd.Function):
    """The loss, passed through, with the parameters as inputs: its backward returns their
    summed gradients (times the loss's incoming gradient), so they reach ``.grad`` through
    autograd like any gradient, once each, also when ``x`` needs none."""

    @staticmethod
    def forward(  # type: ignore[override]  # autograd's signature is variadic
        ctx: Any, loss: Tensor, param_grads: _ParamGrads, *params: Tensor
    ) -> Tensor:
        ctx.param_grads = param_grads
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        scale = grads[0]
        sums = ctx.param_grads.scaled(scale)
        return (scale, None, *sums)


def _tile_weight(y: Tensor, mask: Tensor | None, reduction: str) -> float:
    """How many of a tile's tokens its mean is over: labels other than ``-100`` (integer
    targets; with a mask, masked-in ones), else rows (masked-in ones). 1 for ``"sum"``."""
    if reduction == "sum":
        return 1.0
    if not y.is_floating_point() and y.dim() == 1:
        counted = y != IGNORE_INDEX
        if mask is not None:
            counted = counted & mask.bool()
        return float(counted.sum().item())
    if mask is not None:
        return float(mask.bool().sum().item())
    return float(y.shape[0])


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss over the logits of ``x`` (hidden states) computed tile by tile, so that the
    logits of the whole sequence never exist at once.

    ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)``: ``fn(self, x_tile, y_tile[, mask_tile])`` returns the tile's loss
    (typically ``self.lm_head`` then cross-entropy); ``x`` is ``[batch, seqlen, ...]``, ``y``
    (labels or ``shift_labels``) and ``mask`` (optional, passed to ``fn`` only when given)
    ``[batch, seqlen, ...]``; batch and sequence are flattened and cut into ``shards`` tiles.

    ``output_reduction="sum"``: the sum of the tiles' losses (exact when ``fn`` returns sums,
    or sums divided by a count of the whole sequence). ``"mean"``: ``fn`` returns the mean
    over its tile's counted tokens, and the tiles are weighted by how many tokens they count
    (integer labels other than ``-100``, and masked in when a mask is given; rows for other
    targets): ``sum(w_i * loss_i) / sum(w_i)``, the untiled mean exactly even when tiles hold
    different numbers of counted tokens (uneven cuts, ``-100`` padding). DeepSpeed takes the
    plain mean of the tiles there, exact only for equal counts. A tile with nothing to count
    is still computed (under ZeRO-3 every rank must call the same modules as often), with a
    weight of 0 and its value (a NaN mean) left out; a sequence with nothing to count gives
    a loss of 0 and zero gradients.

    The backward runs inside the forward, tile by tile (DeepSpeed's design: no second
    forward); the input's gradient is kept and the parameters' gradients are summed and
    delivered when autograd reaches this loss, scaled by the incoming gradient (so a loss
    scaled by a loss scaler or by gradient accumulation scales them too).
    """

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        call = _LossCall()
        token = _LOSS_CALL.set(call)
        try:
            loss = super().apply(*args, **kwargs)
        finally:
            _LOSS_CALL.reset(token)
        if call.param_grads.sums:
            loss = _RelayParamGrads.apply(loss, call.param_grads, *call.param_grads.param_list())
        return loss

    @staticmethod
    def forward(  # type: ignore[override]  # autograd's signature is variadic
        ctx: Any,
        fn: Callable[..., Tensor],
        self: Any,
        x: Tensor,
        y: Tensor,
        mask: Tensor | None,
        shards: int,
        compute_params: Sequence[Tensor] | None,
        output_reduction: str,
    ) -> Tensor:
        _check_loss_inputs(x, y, mask, output_reduction)
        call = _LOSS_CALL.get() or _LossCall()
        grad_enabled = call.grad_enabled
        batch, seqlen = x.shape[:2]
        rows_x = x.detach().reshape(-1, *x.shape[2:])
        rows_y = y.reshape(-1, *y.shape[2:])
        rows_mask = None if mask is None else mask.reshape(-1)
        bounds = tile_bounds(rows_x.shape[0], shards)
        weights = [
            _tile_weight(
                rows_y.narrow(0, start, size),
                None if rows_mask is None else rows_mask.narrow(0, start, size),
                output_reduction,
            )
            for start, size in bounds
        ]
        total = sum(weights)
        wants_input_grad = x.requires_grad and grad_enabled
        x_grad = torch.zeros_like(rows_x) if wants_input_grad else None
        param_grads = call.param_grads
        # in float32 at least, as Hugging Face's loss upcasts the logits
        dtype = torch.promote_types(x.dtype, torch.float32)
        losses: list[Tensor] = []
        with _gathered(compute_params):
            for (start, size), weight in zip(bounds, weights, strict=True):
                share = (weight / total if total else 0.0) if output_reduction == "mean" else 1.0
                tile = _tile(rows_x, 0, start, size, wants_input_grad)
                tile_args: tuple[Any, ...] = (self, tile, rows_y.narrow(0, start, size))
                if rows_mask is not None:
                    tile_args += (rows_mask.narrow(0, start, size),)
                with torch.enable_grad() if grad_enabled else torch.no_grad():
                    loss = fn(*tile_args)
                if share:
                    losses.append(loss.detach().to(dtype) * share)
                grad_share = torch.tensor(share, dtype=loss.dtype, device=loss.device)
                got = param_grads.tile_backward(
                    loss, grad_share, [tile] if wants_input_grad else []
                )
                if x_grad is not None and got and got[0] is not None:
                    x_grad.narrow(0, start, size).copy_(got[0])
        result = torch.stack(losses).sum() if losses else torch.zeros(())
        ctx.save_for_backward(None if x_grad is None else x_grad.view(batch, seqlen, *x.shape[2:]))
        return result.to(dtype=dtype, device=x.device)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (x_grad,) = ctx.saved_tensors
        if x_grad is not None:
            x_grad = x_grad * grads[0].to(x_grad.dtype)
        return None, None, x_grad, None, None, None, None, None


def _check_loss_inputs(x: Tensor, y: Tensor, mask: Tensor | None, reduction: Any) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f'unknown output_reduction {reduction!r}: valid values are "mean", "sum"')
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(
            f"x and y must be at least [batch, seqlen], got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(
            f"x and y must agree on [batch, seqlen], got {tuple(x.shape[:2])} and "
            f"{tuple(y.shape[:2])}"
        )
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"mask must be [batch, seqlen]={tuple(x.shape[:2])}, got {tuple(mask.shape)}"
        )
