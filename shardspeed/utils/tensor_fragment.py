"""DeepSpeed's ZeRO debugging and state-editing utilities (``deepspeed.utils.safe_*``).

A parameter's pieces are found through the strategy that trains it
(:func:`~shardspeed.runtime.zero.strategy.strategy_of` and
:meth:`~shardspeed.runtime.zero.strategy.ZeroStrategy.param_fragment`); nothing is stored on the
parameter. "Full" functions are collectives over the data-parallel group when the state is
partitioned (stages 1-3): every rank must call them, in the same order. "Local" functions
act on this rank's piece only: the whole parameter for stage 0, a 1-D slice of the flattened
parameter for stages 1-3 (possibly empty).

Windows of validity follow DeepSpeed: reduced gradients exist after ``backward`` (at the
accumulation boundary) and before ``step``, and before the reduction ``safe_get_full_grad``
gives the gradient this rank accumulated (DeepSpeed's ``param.grad`` at stages 0-1); master
weights and optimizer state at any time after ``initialize`` (optimizer state after the first
step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from shardspeed import comm

if TYPE_CHECKING:
    from shardspeed.runtime.zero.strategy import ParamFragment


def _fragment(param: nn.Parameter) -> ParamFragment | None:
    # imported here: shardspeed.utils sits below the runtime and must not import it eagerly
    from shardspeed.runtime.zero.strategy import strategy_of

    strategy = strategy_of(param)
    return None if strategy is None else strategy.param_fragment(param)


def _state_resident(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``function(param, ...)`` with the optimizer state of ``param``'s engine in memory
    (NVMe offload keeps it in files between steps)."""

    @functools.wraps(function)
    def wrapped(param: nn.Parameter, *args: Any, **kwargs: Any) -> Any:
        from shardspeed.runtime.zero.strategy import strategy_of

        strategy = strategy_of(param)
        if strategy is None:
            return function(param, *args, **kwargs)
        with strategy.optimizer_state_resident():
            return function(param, *args, **kwargs)

    return wrapped


def _state_piece(param: nn.Parameter, key: str) -> tuple[ParamFragment, Tensor] | None:
    from shardspeed.runtime.zero.strategy import strategy_of

    fragment = _fragment(param)
    if fragment is None:
        return None
    strategy = strategy_of(param)
    assert strategy is not None and strategy.optimizer is not None  # a fragment: it trains
    state = strategy.optimizer.state.get(fragment.state_key, {})
    if key not in state:
        raise KeyError(
            f"optimizer state {key!r} does not exist (yet) for this parameter; keys present: "
            f"{sorted(state)} (state is created by the first optimizer step)"
        )
    value = state[key]
    if not isinstance(value, Tensor) or value.numel() != fragment.state_key.numel():
        return fragment, value  # a per-tensor scalar (e.g. "step"): no piece to cut
    return fragment, value.view(-1)[fragment.state_slice]


def _assemble(param: nn.Parameter, fragment: ParamFragment, piece: Tensor) -> Tensor:
    """The full tensor of ``param``'s shape from every rank's piece (a collective if
    partitioned): each rank fills its own elements and the ranks' disjoint pieces are summed."""
    full = torch.zeros(param.numel(), dtype=piece.dtype, device=piece.device)
    full[fragment.param_slice] = piece
    if fragment.partitioned:
        comm.all_reduce(full, group=fragment.group)
    return full.view(param.shape)


def _local(param: nn.Parameter, fragment: ParamFragment, piece: Tensor) -> Tensor:
    if fragment.partitioned:
        return piece.detach().clone()
    return piece.detach().clone().view(param.shape)


def _grad_piece(param: nn.Parameter, fragment: ParamFragment) -> Tensor:
    grad = fragment.grad
    if grad is None:
        raise RuntimeError(
            f"no reduced gradient for the parameter of shape {tuple(param.shape)}: gradients are "
            "available after engine.backward() at the accumulation boundary and before step()"
        )
    return grad


# -- full (collective) -----------------------------------------------------------------------
def safe_get_full_fp32_param(param: nn.Parameter) -> Tensor | None:
    """The full fp32 master value of ``param`` (None if no engine trains it)."""
    fragment = _fragment(param)
    return None if fragment is None else _assemble(param, fragment, fragment.master.float())


def safe_get_full_grad(param: nn.Parameter) -> Tensor | None:
    """The full reduced gradient of ``param``, in the gradient-accumulation dtype; before the
    reduction (inside ``engine.no_sync()``, or before the accumulation boundary) the gradient
    this rank accumulated, as DeepSpeed returns ``param.grad`` then (no collective)."""
    fragment = _fragment(param)
    if fragment is None:
        return None
    if fragment.grad is None and fragment.local_grad is not None:
        return fragment.local_grad.detach().clone().view(param.shape)
    return _assemble(param, fragment, _grad_piece(param, fragment))


@_state_resident
def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``."""
    found = _state_piece(param, optim_state_key)
    if found is None:
        return None
    fragment, piece = found
    if piece.numel() != fragment.state_slice.stop - fragment.state_slice.start:
        return piece.clone()  # a scalar state, identical on every rank
    return _assemble(param, fragment, piece)


@torch.no_grad()
def safe_set_full_fp32_param(param: nn.Parameter, value: Tensor) -> None:
    """Set the fp32 master value of ``param`` from the full ``value`` (and the model weight, so
    forward sees it before the next step)."""
    fragment = _fragment(param)
    if fragment is None:
        return
    fragment.master.copy_(value.reshape(-1)[fragment.param_slice])
    _write_model_weight(param, value, fragment)


def _write_model_weight(param: nn.Parameter, value: Tensor, fragment: ParamFragment) -> None:
    """Put ``value`` in the model's own copy too, so forward sees it before the next step: this
    rank's shard piece of a ZeRO-3 parameter, and the whole tensor wherever it is held (always
    before stage 3; at stage 3 while gathered; writing a released one would touch freed
    memory)."""
    from shardspeed.runtime.zero.utils import is_zero_param

    if is_zero_param(param):
        piece = param.ds_tensor  # type: ignore[attr-defined]  # a ZeroParameter
        piece.copy_(value.reshape(-1)[fragment.param_slice].to(piece.dtype))
        param.ds_tensor_written()  # type: ignore[attr-defined]  # hpZ: drop the stale secondary
    if param.untyped_storage().nbytes() > 0:
        param.data.copy_(value.view(param.shape))


@torch.no_grad()
@_state_resident
def safe_set_full_optimizer_state(param: nn.Parameter, value: Tensor, optim_state_key: str) -> None:
    """Set optimizer state ``optim_state_key`` of ``param`` from its full value."""
    found = _state_piece(param, optim_state_key)
    if found is not None:
        fragment, piece = found
        piece.copy_(value.reshape(-1)[fragment.param_slice])


@torch.no_grad()
def safe_set_full_grad(param: nn.Parameter, value: Tensor) -> None:
    """Set the reduced gradient of ``param`` from a full (un-partitioned) ``value``."""
    fragment = _fragment(param)
    if fragment is not None:
        _grad_piece(param, fragment).copy_(value.reshape(-1)[fragment.param_slice])


def safe_update_full_grad_vectorized(
    param_list: Sequence[nn.Parameter], update_func: Callable[[list[Tensor]], Sequence[Tensor]]
) -> None:
    """Replace the gradients of ``param_list``: ``update_func`` gets the list of full gradients
    and returns the list of new full gradients (a collective, like every full accessor)."""
    params = [p for p in param_list if _fragment(p) is not None]
    full = [safe_get_full_grad(p) for p in params]
    updated = list(update_func([g for g in full if g is not None]))
    if len(updated) != len(params):
        raise ValueError(
            f"update_func returned {len(updated)} gradients for {len(params)} parameters"
        )
    for param, value in zip(params, updated, strict=True):
        safe_set_full_grad(param, value)


# -- local (this rank's piece) ---------------------------------------------------------------
def safe_get_local_fp32_param(param: nn.Parameter) -> Tensor | None:
    """This rank's piece of the fp32 master value of ``param``."""
    fragment = _fragment(param)
    return None if fragment is None else _local(param, fragment, fragment.master.float())


def safe_get_local_grad(param: nn.Parameter) -> Tensor | None:
    """This rank's piece of the reduced gradient of ``param``."""
    fragment = _fragment(param)
    return None if fragment is None else _local(param, fragment, _grad_piece(param, fragment))


@_state_resident
def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Tensor | None:
    """This rank's piece of optimizer state ``optim_state_key`` of ``param``."""
    found = _state_piece(param, optim_state_key)
    return None if found is None else _local(param, found[0], found[1])


@torch.no_grad()
def safe_set_local_fp32_param(param: nn.Parameter, value: Tensor) -> None:
    """Set this rank's piece of the fp32 master value of ``param`` (shaped as the getter's)."""
    fragment = _fragment(param)
    if fragment is not None:
        fragment.master.copy_(value.reshape(-1))


@torch.no_grad()
def safe_set_local_grad(param: nn.Parameter, value: Tensor) -> None:
    """Set this rank's piece of the reduced gradient of ``param``."""
    fragment = _fragment(param)
    if fragment is not None:
        _grad_piece(param, fragment).copy_(value.reshape(-1))


@torch.no_grad()
@_state_resident
def safe_set_local_optimizer_state(
    param: nn.Parameter, value: Tensor, optim_state_key: str
) -> None:
    """Set this rank's piece of optimizer state ``optim_state_key`` of ``param``."""
    found = _state_piece(param, optim_state_key)
    if found is not None:
        found[1].copy_(value.reshape(-1))
