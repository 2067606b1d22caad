"""Rank side of the Megatron-``mpu`` tensor-parallel tests: a model with column- and
row-parallel linears (Megatron's layout) trained on 4 ranks as tensor parallel 2 x data parallel
2, against the same model built whole and trained in one process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardspeed
from shardspeed import comm

DIM, HIDDEN, MICRO_BATCH = 8, 32, 4
LR, CLIP = 0.5, 0.05


class MegatronMpu:
    """A Megatron-style model-parallel unit (the pre-pipeline interface DeepSpeed still reads):
    consecutive ranks form a tensor-parallel group, ranks ``tp`` apart a data-parallel group."""

    def __init__(self, tp: int) -> None:
        world, rank = comm.get_world_size(), comm.get_rank()
        dp = world // tp
        self.tp, self.dp = tp, dp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        # every rank creates every group, in the same order
        self.tp_group = self.dp_group = None
        for start in range(0, world, tp):
            group = comm.new_group(list(range(start, start + tp)))
            if start == rank - self.tp_rank:
                self.tp_group = group
        for offset in range(tp):
            group = comm.new_group(list(range(offset, world, tp)))
            if offset == self.tp_rank:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input gradient summed over the tensor-parallel group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The partial outputs summed over the tensor-parallel group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``full``'s weight and bias (output split, not gathered)."""

    def __init__(self, full: nn.Linear, mpu: MegatronMpu) -> None:
        super().__init__()
        rows = full.out_features // mpu.tp
        part = slice(mpu.tp_rank * rows, (mpu.tp_rank + 1) * rows)
        self.weight = nn.Parameter(full.weight.detach()[part].clone())
        self.bias = nn.Parameter(full.bias.detach()[part].clone())
        for param in (self.weight, self.bias):
            param.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.group = mpu.tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.group)
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``full``'s weight (input split); the bias is whole on every rank
    and added after the sum, so it is not model parallel."""

    def __init__(self, full: nn.Linear, mpu: MegatronMpu) -> None:
        super().__init__()
        cols = full.in_features // mpu.tp
        part = slice(mpu.tp_rank * cols, (mpu.tp_rank + 1) * cols)
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.weight.model_parallel = True  # type: ignore[attr-defined]  # Megatron's older name
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.bias.tensor_model_parallel = False  # type: ignore[attr-defined]
        self.group = mpu.tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTensorParallel.apply(x @ self.weight.t(), self.group)
        return out + self.bias


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` then a replicated head; ``mpu`` splits fc1 by columns
    and fc2 by rows, the layer norms and the head stay whole (replicated) on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1: nn.Module = nn.Linear(DIM, HIDDEN)
        self.fc2: nn.Module = nn.Linear(HIDDEN, DIM)
        self.final_norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 2)
        with torch.no_grad():  # not the default ones and zeros: their gradients differ per entry
            for norm in (self.norm, self.final_norm):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.2, 0.2)

    def split(self, mpu: MegatronMpu) -> Block:
        """This module with fc1 / fc2 replaced by this rank's tensor-parallel shards."""
        assert isinstance(self.fc1, nn.Linear) and isinstance(self.fc2, nn.Linear)
        self.fc1 = ColumnParallelLinear(self.fc1, mpu)
        self.fc2 = RowParallelLinear(self.fc2, mpu)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))
        return self.head(self.final_norm(h))


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(MICRO_BATCH, DIM, generator=gen), torch.randn(MICRO_BATCH, 2, generator=gen)


def _shard_of(name: str, full: torch.Tensor, mpu: MegatronMpu) -> torch.Tensor:
    """The piece of the full model's tensor ``name`` that this rank's shard holds."""
    if name.startswith("fc1."):
        rows = full.shape[0] // mpu.tp
        return full[mpu.tp_rank * rows : (mpu.tp_rank + 1) * rows]
    if name == "fc2.weight":
        cols = full.shape[1] // mpu.tp
        return full[:, mpu.tp_rank * cols : (mpu.tp_rank + 1) * cols]
    return full


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")


def train_against_whole(
    stage: int, steps: int = 3, zero_extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train the split model under ``initialize(mpu=...)`` at ZeRO ``stage`` with clipping, and
    the whole model in this process on both data-parallel ranks' batches; compare each step's
    global norm, the clipped gradients the optimizer steps with, and the parameters after."""
    mpu = MegatronMpu(tp=2)
    torch.manual_seed(7)
    whole = Block()
    torch.manual_seed(7)
    model = Block().split(mpu)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, **(zero_extra or {})},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = shardspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    reference = torch.optim.SGD(whole.parameters(), lr=LR)
    stepped: dict[int, torch.Tensor] = {}

    def record(opt: torch.optim.Optimizer, *_: Any) -> None:
        for group in opt.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    stepped[id(param)] = param.grad.detach().clone()

    engine.optimizer.optimizer.register_step_pre_hook(record)
    named = dict(model.named_parameters())
    norms: list[tuple[float, float]] = []
    for step in range(steps):
        x, y = _batch(step, mpu.dp_rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        # the whole model on the global batch (both data-parallel ranks' micro-batches)
        batches = [_batch(step, d) for d in range(mpu.dp)]
        losses = [nn.functional.mse_loss(whole(bx), by) for bx, by in batches]
        (sum(losses) / len(losses)).backward()  # type: ignore[union-attr]
        expected_norm = float(torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP))
        got_norm = engine.get_global_grad_norm()
        assert got_norm is not None
        norms.append((got_norm, expected_norm))
        for name, full in whole.named_parameters():
            fragment = engine.strategy.param_fragment(named[name])
            assert fragment is not None and full.grad is not None
            want = _shard_of(name, full.grad, mpu).reshape(-1)[fragment.param_slice]
            got = stepped[id(fragment.state_key)].reshape(-1)[fragment.state_slice]
            _close(got, want, f"step {step} clipped gradient of {name}")
        reference.step()
        reference.zero_grad()
        for name, full in whole.named_parameters():
            _close(named[name].detach(), _shard_of(name, full.detach(), mpu), f"step {step} {name}")
    shard_over = engine.strategy.ctx.shard_over
    shards = None
    if shard_over is not None:  # MiCS: (shard group size, replica group size)
        replicas = shard_over.replicated_over
        shards = (shard_over.world_size, 1 if replicas is None else replicas.world_size)
    engine.destroy()
    return {"norms": norms, "tp_rank": mpu.tp_rank, "dp_rank": mpu.dp_rank, "shards": shards}
