"""Rank-side code for parity tests: train a model with the engine on this rank's share of each
global batch, and a single-process reference on the whole batch, and compare step by step.

The single-process reference is what ZeRO stage 0 computes, so ``stage=1``/``2`` runs are
stage-vs-stage-0 parity; they also compare the optimizer state, read back through the
``safe_get_full_optimizer_state`` utility (which exercises the partition bookkeeping)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardspeed
import shardspeed.checkpointing as ckpt
from examples.gpt_model import GPT, GPTConfig, synthetic_tokens
from shardspeed.ops.factory import build_optimizer
from shardspeed.utils import safe_get_full_optimizer_state
from shardspeed.zero import GatheredParameters

# Adam divides by sqrt(v) + eps: with eps=1e-8 an element whose gradient is ~1e-9 turns float
# summation-order noise (two half-batch means vs one full-batch mean) into 1e-6 weight changes.
# A larger eps keeps these tests about the data-parallel machinery, not Adam's conditioning.
EPS = 1e-6
OPT_PARAMS = {"lr": 1e-2, "eps": EPS, "weight_decay": 0.01}
TINY_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


class TwiceMLP(nn.Module):
    """An MLP whose middle layer (one module) runs twice per forward."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.shared = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return nn.functional.mse_loss(self.out(h), y)


def _call(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


class CheckpointedGPT(GPT):
    """The GPT with every block under activation checkpointing (``reentrant`` or not)."""

    def __init__(self, cfg: GPTConfig, reentrant: bool) -> None:
        super().__init__(cfg)
        self.reentrant = reentrant
        #: off for the single-process reference (it takes gradients with autograd.grad)
        self.enabled = True

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        run: Callable[..., Any] = (
            ckpt.checkpoint if self.reentrant else ckpt.non_reentrant_checkpoint
        )
        if not self.enabled:
            run = _call
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = run(block, x)
        logits = self.lm_head(self.ln_f(x))
        assert targets is not None
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        )


@dataclass
class Task:
    """A model factory and a dataset of (input, target) rows."""

    build: Callable[[], nn.Module]
    data: tuple[torch.Tensor, torch.Tensor]


def make_task(kind: str, rows: int, seed: int = 0) -> Task:
    gen = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        x = torch.randn(rows, 16, generator=gen)
        w = torch.randn(16, 1, generator=gen) / 4
        y = torch.tanh(x @ w)
        return Task(lambda: MLP(), (x, y))
    if kind == "twice":
        x = torch.randn(rows, 16, generator=gen)
        y = torch.tanh(x[:, :1])
        return Task(lambda: TwiceMLP(), (x, y))
    if kind.startswith("gpt"):
        ds = synthetic_tokens(rows, TINY_GPT, seed=seed)
        builders: dict[str, Callable[[], nn.Module]] = {
            "gpt": lambda: GPT(TINY_GPT),
            "gpt-ckpt": lambda: CheckpointedGPT(TINY_GPT, reentrant=True),
            "gpt-ckpt-nr": lambda: CheckpointedGPT(TINY_GPT, reentrant=False),
        }
        return Task(builders[kind], (ds.tensors[0], ds.tensors[1]))
    raise ValueError(kind)


def adamw_config(micro: int, gas: int, clip: float, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
        **extra,
    }


def rank_rows(step: int, micro_step: int, micro: int, gas: int) -> slice:
    """Rows of the global batch this rank uses at ``micro_step``: global batches are laid out as
    ``gas`` micro-steps, each of ``world`` consecutive micro-batches."""
    world, rank = dist.get_world_size(), dist.get_rank()
    start = step * micro * gas * world + (micro_step * world + rank) * micro
    return slice(start, start + micro)


def global_rows(step: int, batch: int) -> slice:
    return slice(step * batch, (step + 1) * batch)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float, atol: float
) -> None:
    if not torch.allclose(actual.float(), expected.float(), rtol=rtol, atol=atol):
        diff = (actual.float() - expected.float()).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {diff:.3e} (rtol={rtol}, atol={atol})")


def param_setup(model: nn.Module, groups: bool, freeze: bool) -> list[Any]:
    """What to hand the optimizer: all parameters, or (``groups``) two groups with their own lr
    and weight decay; ``freeze`` first freezes the model's first parameter tensor (a layer)."""
    params = list(model.parameters())
    if freeze:
        params[0].requires_grad_(False)
    trainable = [p for p in params if p.requires_grad]
    if not groups:
        return trainable
    half = len(trainable) // 2
    return [
        {"params": trainable[:half], "lr": 2e-2, "weight_decay": 0.0},
        {"params": trainable[half:], "lr": 5e-3, "weight_decay": 0.1},
    ]


def assert_state_close(
    model: nn.Module, reference: nn.Module, ref_opt: Any, step: int, rtol: float, atol: float
) -> None:
    """Adam moments of every trained parameter, assembled from the partitions, equal the
    reference's (a collective: every rank runs it)."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if not p.requires_grad:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            full = safe_get_full_optimizer_state(p, key)
            assert full is not None
            assert_close(full, ref_opt.state[q][key], f"{name}.{key} at step {step}", rtol, atol)


def reference_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, micro: int, gas: int, world: int
) -> torch.Tensor:
    """Single-process backward over the whole global batch of ``step``: the mean loss over all
    ``world * gas`` micro-batches. It is computed micro-batch by micro-batch in the float order a
    data-parallel run uses (each rank accumulates its micro-batches, then the ranks are summed
    and averaged); a one-shot full-batch backward differs only by rounding, but Adam amplifies
    rounding on near-zero gradient elements, which would hide the comparison."""
    batch = micro * gas * world
    rows = global_rows(step, batch)
    xs, ys = x[rows].split(micro), y[rows].split(micro)
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(())
    summed: list[torch.Tensor] | None = None
    for rank in range(world):
        local: list[torch.Tensor] | None = None
        for micro_step in range(gas):
            i = micro_step * world + rank
            loss = model(xs[i], ys[i])
            total += loss.detach()
            part = torch.autograd.grad(loss / gas if gas > 1 else loss, params)
            local = (
                list(part) if local is None else [a + b for a, b in zip(local, part, strict=True)]
            )
        assert local is not None
        summed = local if summed is None else [a + b for a, b in zip(summed, local, strict=True)]
    assert summed is not None
    for param, grad in zip(params, summed, strict=True):
        param.grad = grad * (1.0 / world)
    return total / (world * gas)


def run_parity(
    kind: str,
    gas: int,
    clip: float,
    steps: int = 20,
    micro: int = 2,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    config_extra: dict[str, Any] | None = None,
    stage: int = 0,
    groups: bool = False,
    freeze: bool = False,
) -> list[float]:
    """Train ``steps`` optimizer steps both ways under ZeRO ``stage``; assert losses, parameters
    and (stages > 0) optimizer state match at every step. ``groups``/``freeze``: see
    :func:`param_setup`. Returns the engine's global losses."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    task = make_task(kind, rows=steps * micro * gas * world)
    reference = task.build()
    model = copy.deepcopy(reference)
    if isinstance(reference, CheckpointedGPT):
        reference.enabled = False
    extra = dict(config_extra or {})
    if stage:
        extra["zero_optimization"] = {**extra.get("zero_optimization", {}), "stage": stage}
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=param_setup(model, groups, freeze),
        config=adamw_config(micro, gas, clip, **extra),
    )
    # the same optimizer class the config builds: this test is about data parallelism (each
    # optimizer is checked against its torch reference in tests/ops)
    ref_opt = build_optimizer("AdamW", param_setup(reference, groups, freeze), OPT_PARAMS)
    x, y = task.data
    losses = []
    for step in range(steps):
        ref_opt.zero_grad()
        ref_loss = reference_backward(reference, x, y, step, micro, gas, world)
        if clip > 0:
            trained = [p for p in reference.parameters() if p.requires_grad]
            torch.nn.utils.clip_grad_norm_(trained, clip)
        ref_opt.step()

        total = torch.zeros(())
        for micro_step in range(gas):
            mine = rank_rows(step, micro_step, micro, gas)
            loss = engine(x[mine], y[mine])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        global_loss = total / (world * gas)
        assert_close(global_loss, ref_loss.detach(), f"loss at step {step}", rtol, atol)
        with GatheredParameters(list(model.parameters())):  # stage 3 holds shards only
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert_close(p.detach(), q.detach(), f"{name} at step {step}", rtol, atol)
        if stage:
            assert_state_close(model, reference, ref_opt, step, rtol, atol)
        losses.append(global_loss.item())
    engine.destroy()
    return losses


def train_global_losses(engine: Any, cfg: GPTConfig, steps: int, seed: int) -> list[float]:
    """``steps`` optimizer steps of ``engine`` (a GPT of ``cfg``), each rank on its own 2 rows
    of a synthetic stream; the mean loss over the ranks at each step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = synthetic_tokens(steps * 2 * world, cfg, seed=seed).tensors
    losses = []
    for step in range(steps):
        rows = slice((step * world + rank) * 2, (step * world + rank + 1) * 2)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
