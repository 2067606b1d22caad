"""Rank-side code for the ZeRO-3 generation-hook tests (run on every rank of a ``dist_pool``).

``detach`` / ``attach`` do what TRL's ``remove_hooks`` / ``add_hooks`` do to
``engine.optimizer.parameter_offload`` (the real TRL functions run in tests/hf/test_trl.py).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardspeed.comm
from examples.gpt_model import GPT
from shardspeed.runtime.zero.module_agreement import FORWARD
from shardspeed.zero import GatheredParameters
from tests.runtime.parity import TINY_GPT, make_task, rank_rows
from tests.runtime.zero.ranks import _engine
from tests.runtime.zero.stage3_ranks import SHARD_ALL, ExternalUser

COLLECTIVES = ("all_gather_into_tensor", "broadcast", "all_reduce", "reduce_scatter_tensor")


def detach(engine: Any) -> None:
    """TRL's ``remove_hooks``."""
    offload = engine.optimizer.parameter_offload
    root = offload.module
    for _, param in itertools.chain(root.named_parameters(), root.ds_external_parameters()):
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def attach(engine: Any) -> None:
    """TRL's ``add_hooks``."""
    offload = engine.optimizer.parameter_offload
    coordinator = offload.param_coordinator
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def module_hooks(model: nn.Module) -> int:
    """How many forward (pre-)hooks the modules of ``model`` carry."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@contextmanager
def counting_collectives() -> Iterator[list[str]]:
    """The names of the collectives ``shardspeed.comm`` runs inside the block."""
    calls: list[str] = []
    originals = {name: getattr(shardspeed.comm, name) for name in COLLECTIVES}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(shardspeed.comm, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(shardspeed.comm, name, fn)


@torch.no_grad()
def greedy(model: nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(new):
        logits = model(tokens)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def _gathered_copy(engine: Any) -> nn.Module:
    """A plain GPT holding ``engine``'s gathered weights (the one-process reference)."""
    plain = GPT(TINY_GPT)
    with GatheredParameters(list(engine.module.parameters())):
        plain.load_state_dict({k: v.clone() for k, v in engine.module.state_dict().items()})
    return plain


def _released(model: nn.Module) -> bool:
    return all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def _step(engine: Any, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
    rows = rank_rows(step, 0, 2, 1)
    loss = engine(x[rows], y[rows])
    engine.backward(loss)
    engine.step()
    return float(loss)


def generate_with_hooks_removed() -> None:
    """TRL's generation path: under GatheredParameters with the hooks removed, greedy decoding
    runs no collective and gives the one-process model's tokens; the hooks come back exactly
    (not doubled), and training after it equals training without it, bit for bit."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    base = task.build()
    x, y = task.data
    engines = [_engine(copy.deepcopy(base), 3, zero=SHARD_ALL) for _ in range(2)]
    generating, plain = engines
    losses: list[list[float]] = [[], []]
    for which, engine in enumerate(engines):
        losses[which].append(_step(engine, x, y, 0))
    prompt = x[:2, :4]
    expected = greedy(_gathered_copy(generating), prompt, 6)
    model = generating.module
    offload = generating.optimizer.parameter_offload
    units = len(generating.strategy.sharding.units)
    installed = module_hooks(model)
    assert len(offload.forward_hooks) == len(offload.backward_hooks) == 2 * units
    with GatheredParameters(list(model.parameters())):
        detach(generating)
        assert offload.forward_hooks == [] and offload.backward_hooks == []
        assert module_hooks(model) == installed - 4 * units  # the guards and root hooks stay
        with counting_collectives() as calls:
            tokens = greedy(model, prompt, 6)
        assert calls == [], calls  # no gather, no agreement check, no release
        attach(generating)
        assert module_hooks(model) == installed
        offload._register_deepspeed_module(model)  # again: idempotent
        assert module_hooks(model) == installed
        assert len(offload.forward_hooks) == len(offload.backward_hooks) == 2 * units
    assert torch.equal(tokens, expected), (tokens, expected)
    assert _released(model)  # the block released what it gathered
    for step in (1, 2):
        for which, engine in enumerate(engines):
            losses[which].append(_step(engine, x, y, step))
    assert losses[0] == losses[1], losses
    after = [_gathered_copy(engine).state_dict() for engine in engines]
    for key, value in after[1].items():
        assert torch.equal(after[0][key], value), key
    for engine in engines:
        engine.destroy()


def coordinator_and_views() -> None:
    """The coordinator maps onto the recorded module order; re-registering never doubles
    hooks; ``ds_active_sub_modules``, ``ds_external_parameters`` and ``parameter_offload``
    below stage 3; destroy takes every hook and view off."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = ExternalUser()
    engine = _engine(model, 3, zero=SHARD_ALL)
    tokens = torch.randint(16, (world, 2, 4), generator=torch.Generator().manual_seed(2))
    seen: dict[str, Any] = {}

    def probe(module: nn.Module, args: Any) -> None:
        seen["mix"] = set(module.weight.ds_active_sub_modules)

    handle = model.mix.register_forward_pre_hook(probe)  # after the engine's own hooks
    engine.backward(engine(tokens[rank], tokens[rank]))
    engine.step()
    handle.remove()
    sharding = engine.strategy.sharding
    mix_unit = next(u for u in sharding.units if u.module is model.mix)
    assert seen["mix"] == {mix_unit.index}
    assert model.mix.weight.ds_active_sub_modules == set()  # its forward is over
    # ds_external_parameters: DeepSpeed's (id, param) pairs, on every module
    assert model.head.ds_external_parameters() == [(id(model.embed.weight), model.embed.weight)]
    assert all(m.ds_external_parameters() == [] for m in (model, model.mix, model.embed))
    offload = engine.optimizer.parameter_offload
    assert offload.module is model
    coordinator = offload.param_coordinator
    order = list(sharding.prefetcher.traces[FORWARD].order)
    assert order and not coordinator.is_invalid_trace()
    coordinator._invalidate_trace()
    assert coordinator.is_invalid_trace() and sharding.prefetcher.traces[FORWARD].order == []
    try:
        coordinator._invalidate_trace()
    except RuntimeError as error:
        assert "already invalid" in str(error)
    else:
        raise AssertionError("invalidating an invalid trace must raise, as DeepSpeed's does")
    engine.backward(engine(tokens[rank], tokens[rank]))
    engine.step()
    assert not coordinator.is_invalid_trace()
    assert sharding.prefetcher.traces[FORWARD].order == order  # recorded again
    installed = module_hooks(model)
    offload._register_deepspeed_module(model.head)  # a submodule: only its hooks, no reset
    assert module_hooks(model) == installed and not coordinator.is_invalid_trace()
    offload._register_deepspeed_module(model)  # the model: hooks replaced, order forgotten
    assert module_hooks(model) == installed and coordinator.is_invalid_trace()
    try:
        offload._register_deepspeed_module(nn.Linear(2, 2))
    except ValueError as error:
        assert "not a module of this ZeRO-3 model" in str(error)
    else:
        raise AssertionError("a module outside the model must be refused")
    stage2 = _engine(ExternalUser(), 2)
    assert not hasattr(stage2.optimizer, "parameter_offload")
    stage2.destroy()
    engine.destroy()
    assert module_hooks(model) == 0
    assert not any("ds_external_parameters" in m.__dict__ for m in model.modules())


def refuses_released_parameters() -> str:
    """Hooks removed without gathering: a forward raises a clear error (on every rank, before
    any collective) instead of computing on empty parameters; with the hooks back it runs."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    engine = _engine(task.build(), 3, zero=SHARD_ALL)
    x, y = task.data
    _step(engine, x, y, 0)
    with torch.no_grad():
        before = engine(x[:2], y[:2])
    detach(engine)
    try:
        with torch.no_grad(), counting_collectives() as calls:
            engine(x[:2], y[:2])
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("a forward on released parameters without hooks must raise")
    assert calls == [], calls
    assert "module hooks are removed" in message and "GatheredParameters" in message, message
    attach(engine)
    with torch.no_grad():
        again = engine(x[:2], y[:2])
    assert torch.equal(again, before)
    _step(engine, x, y, 1)  # training goes on
    engine.destroy()
    return message
