"""The engine as DeepSpeed's own tests and clients use it, on real ranks: attributes falling
through to the wrapped model, ``no_sync()`` refusals caught as ``AssertionError``, the
accumulated gradient inside ``no_sync()`` at ZeRO-1, refused empty checkpoint folders, tag
validation in ``Fail`` mode, and ZeRO-3's fp32 parameter-group calls."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardspeed.utils import safe_get_full_grad
from shardspeed.zero import GatheredParameters
from tests.runtime.parity import MLP
from tests.runtime.zero.ranks import _engine


class Named(nn.Module):
    """A model with attributes of its own that code reaches through the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.moe_1 = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.custom_value = 7
        self.train_batch_size = "the model's"  # the engine's own method must win

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.out(torch.tanh(self.moe_1(x))), y)

    def describe(self) -> str:
        return "the model's method"


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)


def engine_verbs_as_deepspeed(folder: str) -> None:
    for stage in (0, 1):
        torch.manual_seed(0)
        engine = _engine(Named(), stage)
        # attributes: the engine's own first, then the wrapped model's
        assert engine.moe_1 is engine.module.moe_1 and engine.custom_value == 7
        assert engine.describe() == "the model's method"
        assert engine.train_batch_size() == 2 * dist.get_world_size()
        assert not hasattr(engine, "no_such_attribute")
        with pytest.raises(AttributeError, match="neither has its wrapped model.*Named"):
            engine.no_such_attribute  # noqa: B018 - the attribute access is the test
        # DeepSpeed asserts: step() and a second no_sync() inside no_sync()
        with engine.no_sync():
            engine.backward(engine(*_batch(dist.get_rank())))
            with pytest.raises(AssertionError, match=r"illegal to call Engine\.step\(\)"):
                engine.step()
            with pytest.raises(AssertionError, match="reentry is unsupported") as nested:
                with engine.no_sync():
                    pass
            assert isinstance(nested.value, RuntimeError)
        assert engine.micro_steps == 0 and engine.global_steps == 0
        # no checkpoint in (or from) the working directory by accident
        for value in (None, ""):
            with pytest.raises(ValueError, match="save_dir must name the checkpoint folder"):
                engine.save_checkpoint(value)
            with pytest.raises(ValueError, match="load_dir must name the checkpoint folder"):
                engine.load_checkpoint(value)
        assert not any(name.startswith("global_step") for name in os.listdir("."))
        engine.destroy()
    # checkpoint.tag_validation "Fail": DeepSpeed asserts the tag is the same on every rank
    engine = _engine(MLP(width=8), 1, checkpoint={"tag_validation": "Fail"})
    with pytest.raises(AssertionError, match="not consistent across all ranks") as differs:
        engine.save_checkpoint(folder, tag=f"rank{dist.get_rank()}")
    assert isinstance(differs.value, ValueError)
    engine.destroy()


@pytest.mark.timeout(240)
def test_engine_verbs_as_deepspeed(dist_pool, tmp_path):
    dist_pool(2).run(engine_verbs_as_deepspeed, str(tmp_path))
    assert os.listdir(tmp_path) == []


def accumulated_grad_inside_no_sync() -> None:
    """DeepSpeed's test_multiple_ctxts: inside no_sync, safe_get_full_grad gives the gradient
    this rank accumulated (stage 1 as stage 0 and plain autograd), and the same again after
    zero_grad."""
    torch.manual_seed(0)
    base = MLP(width=8)
    reference = copy.deepcopy(base)
    batches = [_batch(10 * dist.get_rank() + i) for i in range(3)]
    for x, y in batches:
        nn.functional.mse_loss(reference.net(x), y).backward()
    expected = [p.grad for p in reference.parameters()]
    norms: dict[int, list[list[float]]] = {}
    for stage in (0, 1):
        engine = _engine(copy.deepcopy(base), stage, gas=1)
        params = list(engine.module.parameters())
        for _ in range(2):
            engine.zero_grad()
            passes = []
            with engine.no_sync():
                for x, y in batches:
                    engine.backward(engine(x, y))
                    passes.append(sum(float(safe_get_full_grad(p).norm()) for p in params))
            norms.setdefault(stage, []).append(passes)
            for param, want in zip(params, expected, strict=True):
                torch.testing.assert_close(safe_get_full_grad(param), want)
        engine.destroy()
    assert norms[0][0] == norms[0][1] and norms[1][0] == norms[1][1]
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]))


@pytest.mark.timeout(240)
def test_accumulated_grad_inside_no_sync(dist_pool):
    dist_pool(2).run(accumulated_grad_inside_no_sync)


def zero3_fp32_param_groups() -> None:
    """DeepSpeed's tests read a ZeRO-3 optimizer's torch state between these two calls."""
    torch.manual_seed(0)
    engine = _engine(MLP(width=8), 3, zero={"stage3_param_persistence_threshold": 0})
    engine.backward(engine(*_batch(dist.get_rank())))
    engine.step()
    engine.optimizer._set_fp32_optimizer_param_groups()
    state = engine.optimizer.optimizer.state_dict()
    engine.optimizer._clear_fp32_optimizer_param_groups()
    assert sum(len(g["params"]) for g in state["param_groups"]) > 0
    assert all("exp_avg" in entry for entry in state["state"].values()) and state["state"]
    first = next(engine.module.parameters())
    with GatheredParameters([first]):
        before = first.detach().clone()
    engine.backward(engine(*_batch(dist.get_rank() + 5)))
    engine.step()  # the groups still hold what the step updates
    with GatheredParameters([first]):
        assert not torch.equal(first.detach(), before)
    engine.destroy()


@pytest.mark.timeout(240)
def test_zero3_fp32_param_groups(dist_pool):
    dist_pool(2).run(zero3_fp32_param_groups)
