"""Rank-side code for the ZeRO stage 3 behaviour tests (run on every rank of a ``dist_pool``)."""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.gpt_model import GPT, GPTConfig
from shardspeed import zero
from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from shardspeed.runtime.zero.partition_parameters import param_status
from shardspeed.runtime.zero.utils import is_zero_param
from shardspeed.utils import safe_get_full_grad, set_z3_leaf_modules, z3_leaf_parameter
from shardspeed.zero import GatheredParameters, ZeroParamStatus
from tests.runtime.parity import make_task, rank_rows
from tests.runtime.zero.ranks import _engine

SHARD_ALL = {"param_persistence_threshold": 0}
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _released(param: nn.Parameter) -> bool:
    return param.untyped_storage().nbytes() == 0


def shards_between_uses() -> None:
    """Between uses every parameter holds no full storage and reports NOT_AVAILABLE; a module's
    parameters are AVAILABLE inside its forward; this rank keeps 1/N of the (padded) model."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * world)
    model = task.build()
    total = sum(p.numel() for p in model.parameters())
    engine = _engine(model, 3, zero=SHARD_ALL)
    params = list(model.parameters())
    assert all(_released(p) for p in params)
    assert {param_status(p) for p in params} == {ZeroParamStatus.NOT_AVAILABLE}
    held = sum(flat.shard.numel() for unit in engine.strategy.sharding.units for flat in unit.flats)
    assert total / world <= held <= total / world + len(engine.strategy.sharding.units) * world
    seen: dict[str, ZeroParamStatus] = {}
    qkv = model.blocks[1].attn.qkv

    def probe(module: nn.Module, args: Any) -> None:
        seen["qkv"] = param_status(module.weight)
        seen["other block"] = param_status(model.blocks[0].mlp[0].weight)

    handle = qkv.register_forward_pre_hook(probe)  # runs after the engine's own pre-hook
    x, y = task.data
    rows = rank_rows(0, 0, 2, 1)
    loss = engine(x[rows], y[rows])
    assert seen == {
        "qkv": ZeroParamStatus.AVAILABLE,
        "other block": ZeroParamStatus.NOT_AVAILABLE,
    }
    assert all(_released(p) for p in params)  # forward done: all released again
    engine.backward(loss)
    engine.step()
    assert all(_released(p) for p in params)
    handle.remove()
    engine.destroy()


def _recording(finish: Any, live: Any, seen: list[int]) -> Any:
    """``finish`` (a unit's ``finish_gather``), noting the gathered elements after each call."""

    def wrapped() -> None:
        finish()
        seen.append(live())

    return wrapped


def eval_state_dict_and_gathered_edits() -> None:
    """``no_grad`` evaluation gives the stage 0 outputs; the full state dict equals the
    gathered weights; ``GatheredParameters(modifier_rank=0)`` edits reach every rank's
    shards (and the optimizer, which steps them), read-only gathers discard edits."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    base = task.build()
    engines = [_engine(copy.deepcopy(base), stage, zero=SHARD_ALL) for stage in (0, 3)]
    x, y = task.data
    for step in range(2):
        rows = rank_rows(step, 0, 2, 1)
        for engine in engines:
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
    reference, sharded = engines
    for engine in engines:
        engine.eval()
    with torch.no_grad():
        expected = reference.module(x[:4])
        actual = sharded.module(x[:4])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    model = sharded.module
    assert all(_released(p) for p in model.parameters())
    # the state dict is gathered one unit at a time, onto the host
    sharding = sharded.strategy.sharding
    most_live: list[int] = []
    for unit in sharding.units:
        unit.finish_gather = _recording(unit.finish_gather, sharding.live_numel, most_live)
    state = sharded.module_state_dict()
    for unit in sharding.units:
        del unit.finish_gather
    largest = max(u.numel + sum(used.numel for used in u.uses) for u in sharding.units)
    assert 0 < max(most_live) <= largest < sum(u.numel for u in sharding.units) / 4
    assert all(_released(p) for p in model.parameters())
    ref_state = reference.module_state_dict()
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert state[key].device.type == "cpu"
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    if "lm_head.weight" in state:  # tied to the embedding: one tensor under both names
        assert state["lm_head.weight"] is state["wte.weight"]

    weight = model.blocks[0].mlp[0].weight
    with GatheredParameters(weight):
        assert param_status(weight) == ZeroParamStatus.AVAILABLE
        original = weight.detach().clone()
        weight.data.fill_(7.0)  # read-only: thrown away on exit
    with GatheredParameters([weight]):
        torch.testing.assert_close(weight.detach(), original)
    with GatheredParameters(weight, modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data.fill_(0.5)
    assert _released(weight)
    with GatheredParameters(weight):
        assert torch.all(weight == 0.5)
    from shardspeed.utils import safe_get_full_fp32_param

    assert torch.all(safe_get_full_fp32_param(weight) == 0.5)  # the optimizer's copy follows
    sharded.train()
    rows = rank_rows(2, 0, 2, 1)
    sharded.backward(sharded(x[rows], y[rows]))
    sharded.step()
    for engine in engines:
        engine.destroy()


def _peak_rss_reset() -> int:
    """Reset this process's peak resident set (Linux) and return the current one, in bytes.

    glibc raises its mmap threshold each time a large block is freed, after which blocks of
    that size come from the heap and stay resident when freed: what this rank did before
    would then decide the peak. A fixed threshold keeps large buffers mapped, so freeing
    returns them and the peak measures this build."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def init_builds_partitioned() -> dict[str, float]:
    """Under ``zero.Init`` the model is born partitioned: no full storage, 1/N held, peak
    resident memory near the share; ``GatheredParameters(modifier_rank=0)`` edits reach every
    rank before any engine exists."""
    world = dist.get_world_size()
    cfg = GPTConfig(vocab_size=512, block_size=16, n_layer=16, n_head=4, n_embd=384)
    torch.manual_seed(0)
    with zero.Init():  # warm-up: the code pages a first build touches count as resident too
        GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32))
    before = _peak_rss_reset()
    with zero.Init():
        model = GPT(cfg)
    peak = _status_kib("VmHWM") * 1024 - before
    params = list(model.parameters())
    full_bytes = sum(p.numel() for p in params) * 4
    assert all(_released(p) for p in params)
    assert all(hasattr(p, "ds_id") for p in params)
    assert {p.ds_status for p in params} == {ZeroParamStatus.NOT_AVAILABLE}
    held = sum(p.ds_tensor.numel() for p in params) * 4
    assert full_bytes / world <= held <= full_bytes / world + 4 * world * len(params)
    weight = model.blocks[3].mlp[0].weight
    assert weight.ds_shape == (4 * cfg.n_embd, cfg.n_embd) and weight.ds_numel == weight.numel()
    with zero.GatheredParameters(weight, modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data.fill_(0.25)
    with zero.GatheredParameters(weight):
        assert torch.all(weight == 0.25)
    return {"peak": float(peak), "full": float(full_bytes), "held": float(held)}


def init_trains_like_a_normal_build() -> None:
    """A model built under ``zero.Init`` has the weights of a normal build and trains the same."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    torch.manual_seed(1)
    with zero.Init():
        partitioned = task.build()
    torch.manual_seed(1)
    normal = task.build()
    engines = [_engine(m, 3, zero=SHARD_ALL) for m in (partitioned, normal)]
    x, y = task.data
    for step in range(3):
        rows = rank_rows(step, 0, 2, 1)
        losses = []
        for engine in engines:
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    with zero.GatheredParameters([*partitioned.parameters(), *normal.parameters()]):
        for p, q in zip(partitioned.parameters(), normal.parameters(), strict=True):
            assert torch.equal(p, q)
    for engine in engines:
        engine.destroy()
    assert not any(hasattr(p, "ds_id") for p in partitioned.parameters())


class Router(nn.Module):
    """Sends its input through the branch its rank picks (as an MoE router may)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        rank = dist.get_rank() if rank is None else rank
        return torch.tanh((self.a if rank % 2 == 0 else self.b)(h))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.router = Router()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        h = self.router(torch.tanh(self.inp(x)), rank)
        return nn.functional.mse_loss(self.out(h), y)


def divergent_branches_fail_fast() -> str:
    """Ranks running different modules get an error naming them, not a hang."""
    torch.manual_seed(0)
    engine = _engine(Branchy(), 3, zero=SHARD_ALL)
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    try:
        engine(x, y)
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("divergent branches ran without an error")
    engine.destroy()
    return message


def leaf_module_makes_branches_work(via_config: bool) -> None:
    """The router marked as a leaf (by class name, or by module name in the config): gathered
    whole, each rank runs its branch, and the reduced gradients equal the mean of the ranks'
    single-process gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    zero_config: dict[str, Any] = dict(SHARD_ALL)
    if via_config:
        zero_config["leaf_module"] = {"names": ["router"]}
    else:
        assert set_z3_leaf_modules(model, ["Router"]) == [model.router]
    engine = _engine(model, 3, zero=zero_config)
    assert all(z3_leaf_parameter(p) for p in model.router.parameters())
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(world, 2, 8, generator=gen), torch.randn(world, 2, 1, generator=gen)
    engine.backward(engine(xs[rank], ys[rank]))
    local = []
    for r in range(world):
        reference.zero_grad()
        reference(xs[r], ys[r], rank=r).backward()
        local.append(
            {
                n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                for n, p in reference.named_parameters()
            }
        )
    for name, param in model.named_parameters():
        expected = sum(g[name] for g in local) / world
        torch.testing.assert_close(safe_get_full_grad(param), expected, rtol=1e-5, atol=1e-7)
    engine.step()
    engine.destroy()


class SharedHead(nn.Module):
    """``head`` applies ``embed``'s weight in its own forward without registering it."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = [embed]  # not a submodule: only the weight is used here
        zero.register_external_parameter(self, embed.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(h, self.embed[0].weight)


class ExternalUser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.head = SharedHead(self.embed)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return nn.functional.cross_entropy(logits.view(-1, 16), targets.view(-1))


def external_parameter_is_gathered(folder: str) -> None:
    """A weight used by another module's forward (registered as external) trains as in a
    single process; is_zero_param, empty_partition_cache, the 16-bit save (refused without
    stage3_gather_16bit_weights_on_model_save) and zero_to_fp32 at stage 3 give the gathered
    weights."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = ExternalUser()
    reference = copy.deepcopy(model)
    engine = _engine(model, 3, zero=SHARD_ALL)
    assert all(is_zero_param(p) for p in model.parameters())
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(16, (world, 2, 4), generator=gen)
    engine.backward(engine(tokens[rank], tokens[rank]))
    grads = torch.autograd.grad(
        sum(reference(tokens[r], tokens[r]) for r in range(world)) / world,
        list(reference.parameters()),
    )
    for (name, param), grad in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(safe_get_full_grad(param), grad, rtol=1e-5, atol=1e-7, msg=name)
    engine.step()
    engine.empty_partition_cache()
    assert all(_released(p) for p in model.parameters())
    assert not engine.save_16bit_model(folder)  # stage3_gather_16bit_weights_on_model_save off
    engine.config.zero_optimization.gather_16bit_weights_on_model_save = True
    assert engine.save_16bit_model(folder, "weights.bin")
    engine.save_checkpoint(folder, tag="t")
    with zero.GatheredParameters(list(model.parameters())):
        gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    assert not is_zero_param(next(model.parameters()))
    if rank == 0:
        saved = torch.load(Path(folder) / "weights.bin", weights_only=True)
        consolidated = get_fp32_state_dict_from_zero_checkpoint(folder, tag="t")
        for name, value in gathered.items():
            assert torch.equal(saved[name], value), name
            assert torch.equal(consolidated[name], value), name
    dist.barrier()
    assert not is_zero_param(next(model.parameters()))


class ScaledStack(nn.Module):
    """A root with a parameter of its own (gathered while its children run), a frozen middle
    layer and trained layers around it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1000))
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))
        self.layers[2].requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x * self.scale[:16]
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(h.sum(-1, keepdim=True), y)


def live_parameters_budget(max_live: int) -> dict[str, float]:
    """Train two steps under ``stage3_max_live_parameters=max_live``; report the peak gathered
    elements, or the error."""
    torch.manual_seed(0)
    model = ScaledStack()
    params = [p for p in model.parameters() if p.requires_grad]
    zero_config = {**SHARD_ALL, "stage3_max_live_parameters": max_live}
    engine = _engine(model, 3, zero=zero_config, model_parameters=params)
    x, y = torch.randn(2, 16), torch.randn(2, 1)
    try:
        for _ in range(2):
            engine.backward(engine(x, y))
            engine.step()
    except RuntimeError as error:
        engine.destroy()
        assert "stage3_max_live_parameters" in str(error), error
        return {"error": 1.0}
    peak = engine.strategy.sharding.peak_live
    largest = max(u.numel for u in engine.strategy.sharding.units)
    engine.destroy()
    return {"peak": float(peak), "largest": float(largest)}


def prefetch_runs_ahead(prefetch: int) -> str:
    """From the second step on, the module after the running one is gathered (or being
    gathered) already: its status when the running module starts."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    model = task.build()
    engine = _engine(model, 3, zero={**SHARD_ALL, "stage3_prefetch_bucket_size": prefetch})
    seen: list[ZeroParamStatus] = []
    nxt = model.blocks[0].attn.proj.weight
    handle = model.blocks[0].attn.qkv.register_forward_pre_hook(
        lambda module, args: seen.append(param_status(nxt))
    )
    x, y = task.data
    for step in range(3):
        rows = rank_rows(step, 0, 2, 1)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    handle.remove()
    assert seen[0] == ZeroParamStatus.NOT_AVAILABLE  # nothing recorded yet
    engine.destroy()
    return ",".join(s.name for s in seen[1:])


class Swapping(nn.Module):
    """Runs its two middle layers in one order on even calls, the other on odd ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if self.calls % 2 == 0 else (self.b, self.a)
        self.calls += 1
        h = torch.tanh(second(torch.tanh(first(torch.tanh(self.inp(x))))))
        return nn.functional.mse_loss(self.out(h), y)


def changing_order_stays_correct() -> int:
    """A forward whose module order changes every step: prefetching follows, drops what it
    predicted wrongly, re-records, and training equals stage 0's."""
    torch.manual_seed(0)
    base = Swapping()
    engines = [_engine(copy.deepcopy(base), stage, zero=SHARD_ALL) for stage in (0, 3)]
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        x, y = torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)
        losses = []
        for engine in engines:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-6, losses
    changes = engines[1].strategy.sharding.prefetcher.traces[0].changes
    for engine in engines:
        engine.destroy()
    return changes


def tiled_linear_under_init() -> None:
    """TiledLinear built partitioned, copying a partitioned layer: the tiles (each its own
    gather unit) equal the layer on every rank."""
    torch.manual_seed(dist.get_rank())  # different on each rank: rank 0's values must win
    with zero.Init():
        big = nn.Linear(10, 7)
        tiled = zero.TiledLinear(10, 7, in_splits=2, out_splits=3, init_linear=big)
    assert all(is_zero_param(p) for p in tiled.parameters())
    x = torch.randn(4, 10)
    with zero.GatheredParameters([*big.parameters(), *tiled.parameters()]):
        torch.testing.assert_close(tiled(x), big(x))
        weights = big.weight.detach().clone()
    everyone = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, weights)
    assert all(torch.equal(w, weights) for w in everyone)


def reuse_keeps_gathered(distance: int) -> str:
    """A module that runs twice per forward: after its first call it stays gathered while it
    is reused within ``stage3_max_reuse_distance``, and is released after its last call."""
    torch.manual_seed(0)
    task = make_task("twice", rows=8 * dist.get_world_size())
    model = task.build()
    zero_config = {**SHARD_ALL, "stage3_max_reuse_distance": distance}
    engine = _engine(model, 3, zero=zero_config)
    seen: list[str] = []
    handle = model.shared.register_forward_hook(  # runs after the engine's own forward hook
        lambda module, args, output: seen.append(param_status(module.weight).name)
    )
    x, y = task.data
    for step in range(2):
        rows = rank_rows(step, 0, 2, 1)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    handle.remove()
    engine.destroy()
    return ",".join(seen[2:])  # the second step's two calls (the first step records)


class _GrowsAParameter(nn.Module):
    """Creates a parameter in its first forward (after initialize)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "late_scale"):
            self.late_scale = nn.Parameter(torch.ones(8))
        return (self.proj(x) * self.late_scale).pow(2).mean()


def new_parameters_are_refused() -> list[str]:
    """A parameter created in a forward, or assigned after initialize, is refused by name (it
    would be neither partitioned nor stepped), on every rank alike."""
    torch.manual_seed(0)
    messages = []
    engine = _engine(_GrowsAParameter(), 3, zero=SHARD_ALL)
    try:
        engine(torch.randn(2, 8))
    except RuntimeError as error:
        messages.append(str(error))
    engine.destroy()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    engine = _engine(model, 3, zero=SHARD_ALL)
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    model[1].extra = nn.Parameter(torch.zeros(1))
    try:
        engine(torch.randn(2, 8))
    except RuntimeError as error:
        messages.append(str(error))
    engine.destroy()
    return messages
