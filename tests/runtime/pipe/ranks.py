"""Rank-side code of the pipeline tests (run on every rank of a ``dist_pool``)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from examples.gpt_model import synthetic_tokens
from shardspeed.checkpoint.planner import CheckpointPlanError
from shardspeed.runtime.pipe.restage import STAGE_SHARD, STAGE_STATES
from tests.checkpoint.plan_spy import (
    captured_plans,
    check_plan,
    edit_record,
    shift_flat_piece,
    transpose_recorded,
)
from tests.runtime.parity import OPT_PARAMS, assert_close
from tests.runtime.pipe.gpt_pipe import TINY, Reference, loss_fn, pipeline_from


def config(micro: int, gas: int, clip: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
        **extra,
    }


class Batches:
    """This rank's micro-batches: global batch ``k`` is ``micro * gas * dp`` rows, data-parallel
    rank ``d`` takes micro-batch ``j`` at rows ``(d * gas + j) * micro``."""

    def __init__(self, data: Any, micro: int, gas: int, dp: int, dp_rank: int) -> None:
        self.data, self.micro, self.gas, self.dp, self.dp_rank = data, micro, gas, dp, dp_rank

    def step(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        base = k * self.micro * self.gas * self.dp
        out = []
        for j in range(self.gas):
            start = base + (self.dp_rank * self.gas + j) * self.micro
            rows = slice(start, start + self.micro)
            out.append((self.data.tensors[0][rows], self.data.tensors[1][rows]))
        return out

    def global_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.micro * self.gas * self.dp
        rows = slice(k * size, (k + 1) * size)
        return self.data.tensors[0][rows], self.data.tensors[1][rows]


def check_params(engine: Any, reference: Reference, what: str, rtol: float, atol: float) -> None:
    for index, layer in engine.module.layer_modules().items():
        expected = reference.layer(index).state_dict()
        for name, value in layer.state_dict().items():
            assert_close(value, expected[name], f"{what} layer {index} {name}", rtol, atol)


def train_parity(
    stages: int,
    steps: int = 10,
    micro: int = 2,
    gas: int = 4,
    clip: float = 0.1,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    module_kwargs: dict[str, Any] | None = None,
    **extra: Any,
) -> list[float]:
    """Pipeline training equals single-process training of the same layers on the same global
    batch: the loss every step (on every stage) and every stage's parameters.

    ``clip`` 0.1 clips every step, so the global norm over the stages (tied weight counted
    once) is exercised each time; a clip threshold the norm hovers around lets float64-vs-
    float32 rounding of the norm decide, and Adam turns that into 1e-5 on near-zero gradients
    (tests/runtime/parity.py). atol 1e-5 is the repository's parity tolerance for the same
    reason."""
    reference = Reference()
    module = pipeline_from(copy.deepcopy(reference), stages, **(module_kwargs or {}))
    engine, *_ = shardspeed.initialize(model=module, config=config(micro, gas, clip, **extra))
    grid = module.mpu()
    dp = grid.get_data_parallel_world_size()
    data = synthetic_tokens(steps * micro * gas * dp, TINY, seed=1)
    batches = Batches(data, micro, gas, dp, grid.get_data_parallel_rank())
    optimizer = torch.optim.AdamW(reference.parameters(), **OPT_PARAMS)
    losses = []
    for k in range(steps):
        loss = engine.train_batch(iter(batches.step(k)))
        tokens, targets = batches.global_batch(k)
        optimizer.zero_grad()
        expected = loss_fn(reference(tokens), targets)
        expected.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        optimizer.step()
        assert_close(loss, expected.detach(), f"step {k} loss", rtol, atol)
        check_params(engine, reference, f"step {k}", rtol, atol)
        losses.append(float(loss))
    assert engine.global_steps == steps
    engine.destroy()
    return losses


def world() -> int:
    return dist.get_world_size()


def activation_memory(micro_batches: int = 8) -> dict[str, int]:
    """The peak number of micro-batches whose activations are alive at once on this stage
    (weak references to each forward's outputs), over a batch of ``micro_batches``."""
    reference = Reference()
    module = pipeline_from(reference, 2)
    engine, *_ = shardspeed.initialize(model=module, config=config(1, micro_batches))
    data = synthetic_tokens(micro_batches, TINY, seed=1)
    batches = Batches(data, 1, micro_batches, 1, 0)
    engine.train_batch(iter(batches.step(0)))
    from shardspeed.runtime.pipe.schedule import TrainSchedule

    buffers = TrainSchedule(micro_batches, 2, module.stage_id).num_pipe_buffers()
    result = {"peak": engine.activation_meter.peak, "buffers": buffers, "alive_after": 0}
    result["alive_after"] = engine.activation_meter.alive()
    engine.destroy()
    return result


def eval_matches_reference() -> None:
    """eval_batch: the mean loss (on every stage) and the last micro-batch's logits (last
    stage) equal the single-process model's; reduce_output=None gives each micro-batch's."""
    reference = Reference()
    module = pipeline_from(copy.deepcopy(reference), 2)
    micro, gas = 2, 3
    engine, *_ = shardspeed.initialize(model=module, config=config(micro, gas))
    data = synthetic_tokens(micro * gas, TINY, seed=2)
    batches = Batches(data, micro, gas, 1, 0)
    loss, logits = engine.eval_batch(iter(batches.step(0)), return_logits=True)
    tokens, targets = batches.global_batch(0)
    with torch.no_grad():
        expected_logits = reference(tokens)
        expected = loss_fn(expected_logits, targets)
    assert_close(loss, expected, "eval loss", 1e-5, 1e-6)
    if engine.is_last_stage():
        assert_close(logits, expected_logits[-micro:], "eval logits", 1e-5, 1e-6)
    else:
        assert logits is None
    per_micro = engine.eval_batch(iter(batches.step(0)), reduce_output=None, num_micro_batches=2)
    if engine.is_last_stage():
        assert len(per_micro) == 2
        first = loss_fn(expected_logits[:micro], targets[:micro])
        assert_close(per_micro[0], first, "first micro-batch loss", 1e-5, 1e-6)
    # evaluation left training as it was, and a training step still matches after it
    assert engine.module.training
    engine.train_batch(iter(batches.step(0)))
    engine.destroy()


def _raises(fn: Any, error: type[BaseException], match: str) -> str:
    try:
        fn()
    except error as caught:
        assert match in str(caught), f"{match!r} not in {caught!r}"
        return str(caught)
    raise AssertionError(f"{fn} did not raise {error.__name__}")


def errors_are_clear_everywhere() -> None:
    """Each mistake raises a message naming the fix, on every rank, and nothing hangs."""
    from shardspeed.pipe import LayerSpec, PipelineError, PipelineModule

    _raises(
        lambda: PipelineModule([torch.nn.Linear(2, 2)] * 3, num_stages=3),
        ValueError,
        "not divisible",
    )
    _raises(
        lambda: PipelineModule([LayerSpec(torch.nn.Linear, 2, 2)], num_stages=2),
        ValueError,
        "every stage needs at least one layer",
    )
    _raises(lambda: PipelineModule([torch.nn.Linear(2, 2)] * 2), ValueError, "num_stages=")
    _raises(
        lambda: PipelineModule(
            [torch.nn.Linear(2, 2)] * 2, num_stages=2, partition_method="profile"
        ),
        NotImplementedError,
        "profile",
    )
    _raises(
        lambda: shardspeed.initialize(
            model=pipeline_from(Reference(), 2), config=config(1, 2, zero_optimization={"stage": 2})
        ),
        ValueError,
        "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
    )
    engine, *_ = shardspeed.initialize(model=pipeline_from(Reference(), 2), config=config(2, 4))
    data = synthetic_tokens(16, TINY, seed=3)
    batches = Batches(data, 2, 4, 1, 0)
    # a data iterator that runs dry mid-batch: every rank raises, naming the fix
    _raises(lambda: engine.train_batch(iter(batches.step(0)[:2])), PipelineError, "ran dry")
    for verb in (engine.forward, engine.backward, engine.step):
        _raises(lambda verb=verb: verb(None), PipelineError, "Only train_batch()")
    with torch.no_grad():
        _raises(lambda: engine.train_batch(iter(batches.step(0))), PipelineError, "eval_batch")
    loss = engine.train_batch(iter(batches.step(0)))  # still usable after the errors
    assert torch.isfinite(loss)
    engine.destroy()
    # no loss_fn and a last stage whose output is not a loss: caught after the schedule
    module = pipeline_from(Reference(), 2)
    module.loss_fn = None
    engine, *_ = shardspeed.initialize(model=module, config=config(2, 4))
    before = [p.detach().clone() for p in module.parameters()]
    _raises(lambda: engine.train_batch(iter(batches.step(0))), PipelineError, "loss_fn")
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    for param in module.parameters():  # the failed batch left no gradient behind
        grad = engine._accumulated_grad(param)
        assert grad is None or not grad.any()
    engine.destroy()


def _train_steps(
    engine: Any,
    reference: Reference,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    steps: range,
    clip: float,
) -> None:
    """Train both side by side over global batches ``steps``, checking parity each step."""
    for k in steps:
        loss = engine.train_batch(iter(batches.step(k)))
        tokens, targets = batches.global_batch(k)
        optimizer.zero_grad()
        expected = loss_fn(reference(tokens), targets)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        optimizer.step()
        assert_close(loss, expected.detach(), f"step {k} loss", 1e-5, 1e-5)
        check_params(engine, reference, f"step {k}", 1e-5, 1e-5)


def checkpoint_across_degrees(
    save_dir: str, zero_stage: int, save_stages: int, load_stages: list[int]
) -> None:
    """Save after 3 steps at pipeline ``save_stages``; load at each of ``load_stages`` (the
    data-parallel degree follows) into a model started from other weights, and train 3 more
    steps in parity with the single-process model continued from the same point."""
    micro, gas, clip = 2, 2, 0.1
    data = synthetic_tokens(6 * micro * gas * world(), TINY, seed=4)
    extra = {"zero_optimization": {"stage": zero_stage}}
    reference = Reference()
    optimizer = torch.optim.AdamW(reference.parameters(), **OPT_PARAMS)
    module = pipeline_from(copy.deepcopy(reference), save_stages)
    engine, *_ = shardspeed.initialize(model=module, config=config(micro, gas, clip, **extra))
    grid = module.mpu()
    dp = grid.get_data_parallel_world_size()
    batches = Batches(data, micro, gas, dp, grid.get_data_parallel_rank())
    _train_steps(engine, reference, optimizer, batches, range(3), clip)
    engine.save_checkpoint(save_dir, tag="t3", client_state={"note": "pipe"})
    engine.destroy()
    for stages in load_stages:
        ref, opt = copy.deepcopy((reference, optimizer))
        module = pipeline_from(Reference(seed=7), stages)
        engine, *_ = shardspeed.initialize(model=module, config=config(micro, gas, clip, **extra))
        with captured_plans() as plans:  # the one reader ran, and checked the save's record
            _, client = engine.load_checkpoint(save_dir)
        check_plan(plans[0])
        assert client == {"note": "pipe"} and engine.global_steps == 3
        check_params(engine, ref, f"loaded at pipe {stages}", 1e-5, 1e-5)
        grid = module.mpu()
        dp = grid.get_data_parallel_world_size()
        batches = Batches(data, micro, gas, dp, grid.get_data_parallel_rank())
        _train_steps(engine, ref, opt, batches, range(3, 6), clip)
        engine.destroy()


def record_checked(save_dir: str) -> None:
    """The tag of :func:`checkpoint_across_degrees` (pipeline 2 x data 2, ZeRO 1) with its
    record edited: the tied embedding recorded transposed, or a stage shard's piece moved, is
    refused on every rank naming the tensor; without a record (as written before it) the tag
    loads unchecked."""
    path = Path(save_dir) / "t3" / STAGE_STATES.format(0)
    pristine = path.read_bytes()
    engine, *_ = shardspeed.initialize(
        model=pipeline_from(Reference(seed=7), 2),
        config=config(2, 2, 0.1, zero_optimization={"stage": 1}),
    )
    rank, embed = dist.get_rank(), "tied_modules.embed.weight"
    shard = STAGE_SHARD.format(1, 0)
    for edit, match in (
        (transpose_recorded(embed), f"tensor '{embed}' is saved in"),
        (shift_flat_piece(shard, -1), "is recorded twice over"),
    ):
        changed = edit_record(path, edit) if rank == 0 else None
        dist.barrier()
        try:
            engine.load_checkpoint(save_dir)
        except CheckpointPlanError as error:
            assert re.search(match, str(error)), error
            assert changed is None or f"'{changed}'" in str(error), (changed, error)
        else:
            raise AssertionError(f"an edited record ({match}) was loaded")
        dist.barrier()
        if rank == 0:
            path.write_bytes(pristine)
    if rank == 0:
        edit_record(path, None)
    dist.barrier()
    with captured_plans() as plans:
        engine.load_checkpoint(save_dir)
    check_plan(plans[0], recorded=False)
    assert engine.global_steps == 3
    engine.destroy()


def low_precision(dtype: str, monitor_dir: str, steps: int = 6) -> list[float]:
    """fp16 (loss scaling) or bf16 pipeline training follows the fp32 single-process model
    within the dtype's tolerance; the LR schedule steps once per batch; the CSV monitor gets
    the batch loss."""
    precision = (
        {"fp16": {"enabled": True, "initial_scale_power": 8}}
        if dtype == "fp16"
        else {"bf16": {"enabled": True}}
    )
    scheduler = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
    }
    micro, gas = 2, 4
    reference = Reference()
    module = pipeline_from(copy.deepcopy(reference), 2)
    engine, *_ = shardspeed.initialize(
        model=module,
        config=config(
            micro,
            gas,
            0.1,
            scheduler=scheduler,
            csv_monitor={"enabled": True, "output_path": monitor_dir, "job_name": "pipe"},
            **precision,
        ),
    )
    expected_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    assert all(p.dtype == expected_dtype for p in module.parameters())
    data = synthetic_tokens(steps * micro * gas, TINY, seed=5)
    batches = Batches(data, micro, gas, 1, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), **OPT_PARAMS)
    lrs, losses = [], []
    for k in range(steps):
        lr_used = engine.get_lr()[0]
        loss = engine.train_batch(iter(batches.step(k)))
        lrs.append(engine.get_lr()[0])
        for group in optimizer.param_groups:
            group["lr"] = lr_used
        tokens, targets = batches.global_batch(k)
        optimizer.zero_grad()
        expected = loss_fn(reference(tokens), targets)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        optimizer.step()
        assert_close(loss, expected.detach(), f"{dtype} step {k} loss", 3e-2, 3e-2)
        losses.append(float(loss))
    assert lrs == sorted(lrs) and lrs[0] < lrs[-1] <= 1e-2, lrs
    assert engine.skipped_steps == 0
    engine.destroy()
    return losses


def changing_shapes(dynamic: bool) -> None:
    """Inputs whose sequence length changes between batches, and within one batch: the engine
    describes the activations again (without ``dynamic_shape``, because the first stage's
    inputs changed; with it, every message) and training stays in parity."""
    micro, gas, clip = 2, 2, 0.1
    reference = Reference()
    module = pipeline_from(copy.deepcopy(reference), 2, dynamic_shape=dynamic)
    engine, *_ = shardspeed.initialize(model=module, config=config(micro, gas, clip))
    optimizer = torch.optim.AdamW(reference.parameters(), **OPT_PARAMS)
    data = synthetic_tokens(5 * micro * gas, TINY, seed=6)
    tokens_all, targets_all = data.tensors
    for k, lengths in enumerate([(8, 8), (8, 8), (6, 6), (6, 4), (8, 8)]):
        micro_batches = []
        for j, length in enumerate(lengths):
            rows = slice((k * gas + j) * micro, (k * gas + j + 1) * micro)
            micro_batches.append((tokens_all[rows, :length], targets_all[rows, :length]))
        loss = engine.train_batch(iter(micro_batches))
        optimizer.zero_grad()
        expected = torch.stack([loss_fn(reference(x), y) for x, y in micro_batches]).mean()
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        optimizer.step()
        assert_close(loss, expected.detach(), f"batch {k} {lengths} loss", 1e-5, 1e-5)
        check_params(engine, reference, f"batch {k} {lengths}", 1e-5, 1e-5)
    engine.destroy()


def module_api() -> None:
    """What PipelineModule builds where, and DeepSpeed's names for its checkpoint files."""
    from shardspeed.pipe import LayerSpec, PipelineModule

    built: list[str] = []

    class Counted(torch.nn.Linear):
        def __init__(self, name: str) -> None:
            super().__init__(4, 4)
            if self.weight.device.type != "meta":
                built.append(name)

    specs = [LayerSpec(Counted, f"l{i}") for i in range(6)]
    stage = dist.get_rank()
    module = PipelineModule(specs, num_stages=2)  # parameters: 3 layers each, counted on meta
    assert built == [f"l{i}" for i in range(3 * stage, 3 * stage + 3)], built
    assert sorted(module.state_dict()) == sorted(
        f"{i}.{p}" for i in range(3 * stage, 3 * stage + 3) for p in ("weight", "bias")
    )
    assert module.topology().get_dim("pipe") == 2 and module.mpu().get_stage_id() == stage
    assert module.ckpt_prefix("/c", "t") == f"/c/t/module-pipe_{stage:02d}"
    assert module.ckpt_layer_path("/c/t", 0) == f"/c/t/layer_{3 * stage:02d}-model_states.pt"
    assert module.get_additional_losses() is None
    typed = PipelineModule(
        [torch.nn.ReLU(), *[torch.nn.Linear(4, 4) for _ in range(4)], torch.nn.ReLU()],
        num_stages=2,
        partition_method="type:linear",
    )
    assert typed.parts == [0, 3, 6], typed.parts  # two Linear layers per stage
    uniform = PipelineModule(
        torch.nn.Sequential(*[torch.nn.ReLU() for _ in range(5)]),
        num_stages=2,
        partition_method="uniform",
    )
    assert uniform.parts == [0, 3, 5]
    grid = module.mpu()
    assert grid.get_data_parallel_world_size() == 1 and grid.get_pipe_parallel_world_size() == 2
    assert grid.stage_to_global(1) == 1 and grid.get_model_parallel_world_size() == 2


class _Split(torch.nn.Module):
    """tokens -> (hidden, mask, scale): a float that needs grad, a bool and a float that
    do not travel with gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(TINY.vocab_size, TINY.n_embd)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.embed(tokens), tokens % 2 == 0, torch.full((tokens.shape[0], 1, 1), 0.5)


class _Mix(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(TINY.n_embd, TINY.n_embd)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, mask, scale = inputs
        return torch.tanh(self.lin(hidden)) * (1 + mask.unsqueeze(-1)) * scale, mask, scale


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(TINY.n_embd, TINY.vocab_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.out(inputs[0])  # type: ignore[no-any-return]


def tuple_messages() -> None:
    """Stages exchange tuples holding tensors that need no gradient (a bool mask, a constant),
    micro-batches go through set_batch_fn, and training equals the single-process layers."""
    from shardspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [_Split(), _Mix(), _Mix(), _Head()]
    reference = copy.deepcopy(layers)
    module = PipelineModule(
        copy.deepcopy(layers), num_stages=2, loss_fn=loss_fn, partition_method="uniform"
    )
    engine, *_ = shardspeed.initialize(model=module, config=config(2, 2, 0.0))
    engine.set_batch_fn(lambda batch: (batch["tokens"], batch["targets"]))
    params = [p for layer in reference for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, **OPT_PARAMS)
    data = synthetic_tokens(12, TINY, seed=8)
    for k in range(3):
        rows = [slice((2 * k + j) * 2, (2 * k + j + 1) * 2) for j in range(2)]
        micro = [{"tokens": data.tensors[0][r], "targets": data.tensors[1][r]} for r in rows]
        loss = engine.train_batch(iter(micro))
        optimizer.zero_grad()
        outs = []
        for m in micro:
            x: Any = m["tokens"]
            for layer in reference:
                x = layer(x)
            outs.append(loss_fn(x, m["targets"]))
        expected = torch.stack(outs).mean()
        expected.backward()
        optimizer.step()
        assert_close(loss, expected.detach(), f"step {k} loss", 1e-5, 1e-5)
    for index, layer in module.layer_modules().items():
        for name, value in layer.state_dict().items():
            assert_close(value, reference[index].state_dict()[name], name, 1e-5, 1e-5)
    try:
        with engine.coalesce_grad_reduction():
            pass
    except NotImplementedError:
        pass
    else:
        raise AssertionError("coalesce_grad_reduction() must refuse under pipeline parallelism")
    engine.destroy()


def _counting(calls: dict[str, int]) -> Any:
    """A forward hook counting calls by module class into ``calls``."""

    def hook(module: torch.nn.Module, *_: Any) -> None:
        calls[type(module).__name__] = calls.get(type(module).__name__, 0) + 1

    return hook


def checkpointable_layers_and_compile() -> dict[str, int]:
    """``checkpointable_layers`` picks which layers activation checkpointing recomputes (by
    class name), and ``compile()`` compiles each layer of the stage; both train in parity."""
    counts: dict[str, int] = {}
    for kinds in (["Block"], ["LayerNorm"]):
        reference = Reference()
        module = pipeline_from(
            copy.deepcopy(reference),
            2,
            activation_checkpoint_interval=1,
            checkpointable_layers=kinds,
        )
        calls: dict[str, int] = {}
        for layer in module.layer_modules().values():
            layer.register_forward_hook(_counting(calls))
        engine, *_ = shardspeed.initialize(model=module, config=config(2, 2, 0.1))
        batches = Batches(synthetic_tokens(2 * 2 * 2, TINY, seed=1), 2, 2, 1, 0)
        optimizer = torch.optim.AdamW(reference.parameters(), **OPT_PARAMS)
        _train_steps(engine, reference, optimizer, batches, range(2), 0.1)
        for name, count in calls.items():
            counts[f"{kinds[0]}:{name}"] = count
        engine.destroy()
    reference = Reference()
    module = pipeline_from(copy.deepcopy(reference), 2)
    module.compile(backend="eager")
    engine, *_ = shardspeed.initialize(model=module, config=config(2, 2, 0.1))
    batches = Batches(synthetic_tokens(2 * 2 * 2, TINY, seed=1), 2, 2, 1, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), **OPT_PARAMS)
    _train_steps(engine, reference, optimizer, batches, range(2), 0.1)
    counts["compiled"] = int(
        all(
            getattr(m, "_compiled_call_impl", None) is not None
            for m in module.layer_modules().values()
        )
    )
    engine.destroy()
    return counts


class _Widens(torch.nn.Module):
    """Appends ``extra`` columns of ones: set ``extra`` to change the output's shape while the
    input's stays."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = 0
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x * self.scale, x.new_ones(x.shape[0], self.extra)], dim=1)


class _RowMean(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1, keepdim=True)


def output_shape_change_stops_every_rank() -> str:
    """Without dynamic_shape, a stage whose output changes shape while its input does not
    ends the batch with an error on every rank (zeros go in its place), never a hang."""
    from shardspeed.pipe import PipelineModule
    from shardspeed.runtime.pipe.module import PipelineError

    torch.manual_seed(0)
    widen = _Widens()
    layers = [torch.nn.Linear(4, 4), widen, _RowMean(), torch.nn.Linear(1, 1)]
    module = PipelineModule(
        layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform"
    )
    engine, *_ = shardspeed.initialize(model=module, config=config(2, 2, 0.0))
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(4)]
    engine.train_batch(iter(data[:2]))
    widen.extra = 1  # only the stage holding it sees this
    try:
        engine.train_batch(iter(data[2:]))
    except PipelineError as error:
        message = str(error)
    else:
        message = ""
    engine.destroy()
    return message
