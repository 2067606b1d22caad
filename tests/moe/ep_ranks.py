"""Rank-side code of the expert-parallel tests: the MoE layer and a GPT-MoE trained by the
engine at ``ep_size`` 1, 2 and 4, each against a single-process ``ep_size=1`` reference."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardspeed
from examples.gpt_model import GPTConfig, synthetic_tokens
from examples.gpt_moe_model import GPTMoE, MoEConfig, global_expert_name
from shardspeed.checkpoint.planner import PLAN_KEY, CheckpointPlanError
from shardspeed.moe.layer import MoE
from shardspeed.moe.utils import configure_moe_param_groups
from shardspeed.ops.factory import build_optimizer
from shardspeed.runtime.zero.partition_parameters import GatheredParameters
from shardspeed.utils import groups, safe_get_full_grad
from tests.checkpoint.plan_spy import captured_plans, check_plan, edit_record, transpose_recorded
from tests.runtime.parity import (
    OPT_PARAMS,
    assert_close,
    reference_backward,
    train_global_losses,
)

HIDDEN, EXPERTS = 8, 4
TINY = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=16)  # MoE: 1, 3


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))


def _layer(ep_size: int, k: int, drop_tokens: bool) -> MoE:
    torch.manual_seed(0)
    return MoE(
        HIDDEN,
        _expert(),
        num_experts=EXPERTS,
        ep_size=ep_size,
        k=k,
        capacity_factor=0.75,
        min_capacity=0,
        drop_tokens=drop_tokens,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )


def layer_parity(k: int, drop_tokens: bool, ragged: bool) -> list[int]:
    """The layer at every ``ep_size`` dividing the world equals the ``ep_size=1`` layer run on
    the same local tokens: outputs, ``l_aux``, ``exp_counts``, input and gate gradients; an
    expert's gradient equals the sum over its expert-parallel group of the reference's.
    ``ragged``: ranks route different numbers of tokens. Returns the sizes checked."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = 6 + (2 * rank if ragged else 0)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    checked = []
    for ep_size in (s for s in (1, 2, 4) if world % s == 0):
        reference = _layer(1, k, drop_tokens)
        layer = _layer(ep_size, k, drop_tokens)
        layer.set_deepspeed_parallelism()
        name = groups.expert_group_name(ep_size)
        ep_rank, local = groups._get_expert_parallel_rank(name), EXPERTS // ep_size
        ref_params = dict(reference.named_parameters())
        with torch.no_grad():
            for pname, p in layer.named_parameters():
                p.copy_(ref_params[global_expert_name(pname, ep_rank, local)])
        x_ref, x_ep = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out_ref, aux_ref, counts_ref = reference(x_ref)
        out_ep, aux_ep, counts_ep = layer(x_ep)
        (out_ref.square().sum() + aux_ref).backward()
        (out_ep.square().sum() + aux_ep).backward()
        what = f"ep_size={ep_size} k={k} drop={drop_tokens} ragged={ragged}"
        assert_close(out_ep, out_ref, f"output, {what}", 1e-5, 1e-6)
        assert_close(aux_ep, aux_ref, f"l_aux, {what}", 1e-6, 1e-7)
        assert torch.equal(counts_ep, counts_ref), what
        assert x_ep.grad is not None and x_ref.grad is not None
        assert_close(x_ep.grad, x_ref.grad, f"input grad, {what}", 1e-5, 1e-6)
        ep_group = groups._get_expert_parallel_group(name)
        for pname, p in reference.named_parameters():
            if "deepspeed_experts" in pname:  # an expert learns from its whole EP group
                assert p.grad is not None
                dist.all_reduce(p.grad, group=ep_group)
        for pname, p in layer.named_parameters():
            expected = ref_params[global_expert_name(pname, ep_rank, local)].grad
            assert p.grad is not None and expected is not None
            assert_close(p.grad, expected, f"{pname} grad, {what}", 1e-5, 1e-6)
        checked.append(ep_size)
    return checked


def _mapped(model: GPTMoE, ep_size: int) -> list[tuple[str, nn.Parameter, str]]:
    """(local name, parameter, name in the ep_size=1 reference) of every parameter."""
    name = groups.expert_group_name(ep_size)
    ep_rank = groups._get_expert_parallel_rank(name)
    local = model.moe_cfg.num_experts // ep_size
    return [(n, p, global_expert_name(n, ep_rank, local)) for n, p in model.named_parameters()]


def engine_parity(
    stage: int,
    ep_size: int,
    steps: int = 10,
    gas: int = 1,
    clip: float = 0.5,
    micro: int = 2,
    moe: dict[str, Any] | None = None,
    first_step: int = 0,
    load_dir: str | None = None,
    save_dir: str | None = None,
    config_extra: dict[str, Any] | None = None,
    moe_param_groups: bool = False,
    zero_init: str = "",
) -> list[float]:
    """Train the GPT-MoE with the engine (``ep_size``, ZeRO ``stage``) and a single-process
    ``ep_size=1`` copy on the whole global batch; assert losses, parameters and (``clip=0``)
    reduced gradients, expert and dense, agree at every step. ``load_dir``: both resume from
    there first (the engine from its checkpoint, whatever its world and ``ep_size``);
    ``save_dir``: both save there after; ``zero_init``: the engine's model is built under
    ``zero.Init`` (``"build"``) or partitioned by ``zero.Init(module=...)`` after it is built
    (``"module"``). Returns the global losses."""
    world, rank = dist.get_world_size(), dist.get_rank()
    options = {"num_experts": 4, "k": 2, "drop_tokens": True, "capacity_factor": 1.0, **(moe or {})}
    torch.manual_seed(0)
    reference = GPTMoE(TINY, MoEConfig(ep_size=1, **options))
    torch.manual_seed(0)
    with shardspeed.zero.Init(enabled=zero_init == "build"):  # partitioned as it is built
        model = GPTMoE(TINY, MoEConfig(ep_size=ep_size, **options))
    if zero_init == "module":  # every parameter over data parallel, experts included
        shardspeed.zero.Init(module=model)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        **(config_extra or {}),
    }
    # moe_param_groups: the experts in optimizer groups of their own, as DeepSpeed users build
    # them (moe.utils.configure_moe_param_groups); the same arithmetic either way
    params = configure_moe_param_groups(list(model.parameters())) if moe_param_groups else None
    engine, *_ = shardspeed.initialize(model=model, model_parameters=params, config=config)
    ref_params = dict(reference.named_parameters())
    mapped = _mapped(model, ep_size)
    ref_opt = build_optimizer("AdamW", list(reference.parameters()), OPT_PARAMS)
    if load_dir is not None:
        with captured_plans() as plans:  # the one reader ran, and checked the save's record
            engine.load_checkpoint(load_dir, tag="t")
        check_plan(plans[0])
        saved = torch.load(f"{load_dir}/reference.pt", weights_only=True)
        reference.load_state_dict(saved["model"])
        ref_opt.load_state_dict(saved["optimizer"])
    with GatheredParameters(list(model.parameters())):  # ZeRO-3: every rank's shards
        for local_name, p, ref_name in mapped:  # the engine starts from the same weights
            # (resumed: as far as the saving run was allowed to drift, see below)
            rtol, atol = (1e-5, 2e-5) if load_dir else (0.0, 0.0)
            what = f"{local_name} at start"
            assert_close(p.detach(), ref_params[ref_name].detach(), what, rtol, atol)
    data = synthetic_tokens((first_step + steps) * micro * gas * world, TINY, seed=1)
    x, y = data.tensors
    losses: list[float] = []
    norms: list[float] = []
    for step in range(first_step, first_step + steps):
        ref_opt.zero_grad()
        ref_loss = reference_backward(reference, x, y, step, micro, gas, world)
        if clip > 0:
            ref_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), clip)
        total = torch.zeros(())
        for micro_step in range(gas):
            start = step * micro * gas * world + (micro_step * world + rank) * micro
            rows = slice(start, start + micro)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            if micro_step == gas - 1 and clip <= 0:
                for local_name, p, ref_name in mapped:
                    grad, ref_grad = safe_get_full_grad(p), ref_params[ref_name].grad
                    assert grad is not None and ref_grad is not None, local_name
                    assert_close(grad, ref_grad, f"{local_name} grad at {step}", 1e-5, 1e-6)
            engine.step()
            total += loss.detach()
        ref_opt.step()
        if clip > 0:  # the norm clipped by: each expert counted once
            norm = engine.get_global_grad_norm()
            assert norm is not None
            assert_close(torch.tensor(norm), ref_norm, f"gradient norm at step {step}", 1e-5, 0)
            norms.append(float(ref_norm))
        dist.all_reduce(total)
        global_loss = total / (world * gas)
        assert_close(global_loss, ref_loss.detach(), f"loss at step {step}", 1e-5, 1e-6)
        with GatheredParameters(list(model.parameters())):
            for local_name, p, ref_name in mapped:
                # gloo's 4-rank reductions sum in an order that depends on where an element
                # sits in its bucket, and Adam turns that last-bit noise on near-zero gradients
                # into parameter differences of ~1e-5 after 10 steps (see tests/runtime/parity.py)
                ref = ref_params[ref_name].detach()
                assert_close(p.detach(), ref, f"{local_name} at step {step}", 1e-5, 2e-5)
        losses.append(global_loss.item())
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t")
        engine.save_16bit_model(save_dir, "model16.pt")  # every expert, gathered
        if rank == 0:
            state = {"model": reference.state_dict(), "optimizer": ref_opt.state_dict()}
            torch.save(state, f"{save_dir}/reference.pt")
        dist.barrier()
    engine.destroy()
    if clip > 0:
        assert max(norms) > clip, norms  # clipping took part
    return losses


def precision_run(dtype: str, ep_size: int, stage: int, steps: int = 6) -> list[float]:
    """Train the GPT-MoE in ``dtype`` (``bf16``/``fp16``) for ``steps``; the global losses."""
    torch.manual_seed(0)
    model = GPTMoE(TINY, MoEConfig(ep_size=ep_size, num_experts=4, k=2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        dtype: {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    losses = train_global_losses(engine, TINY, steps, seed=1)
    engine.destroy()
    return losses


def group_layout(use_data_before: bool) -> tuple[list[int], list[int]]:
    """This rank's (expert-parallel, expert-data-parallel) ranks for ep_size 2, made afresh in
    the order asked for."""
    groups._forget_expert_groups()
    groups._create_expert_and_data_parallel(2, use_data_before)
    name = groups.expert_group_name(2)
    return groups._get_expert_parallel_ranks(name), groups._get_expert_data_parallel_ranks(name)


def data_before_expert_parity() -> list[float]:
    """Training in parity with the expert-data-parallel ranks consecutive."""
    groups._forget_expert_groups()
    try:
        extra = {"use_data_before_expert_parallelism": True}
        losses = engine_parity(1, 2, steps=4, config_extra=extra)
        made = groups._get_expert_parallel_ranks(groups.expert_group_name(2))
        assert made == [dist.get_rank() % 2, dist.get_rank() % 2 + 2], made
        return losses
    finally:
        groups._forget_expert_groups()


def stage_losses(stage: int, ep_size: int, steps: int = 4) -> list[float]:
    """The global losses of the GPT-MoE trained at ZeRO ``stage`` (fp32, no clipping)."""
    torch.manual_seed(0)
    model = GPTMoE(TINY, MoEConfig(ep_size=ep_size, num_experts=4, k=2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    losses = train_global_losses(engine, TINY, steps, seed=1)
    engine.destroy()
    return losses


def load_weights_only(folder: str, ep_size: int) -> int:
    """Load the module weights of ``folder``'s tag ``t`` (optimizer state left out) into a
    fresh GPT-MoE at ``ep_size``; every parameter must equal the saved reference's. Returns
    how many parameters were compared."""
    torch.manual_seed(1)  # other initial weights than the saved model's: loading must set them
    model = GPTMoE(TINY, MoEConfig(ep_size=ep_size, num_experts=4, k=2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    with captured_plans() as plans:
        engine.load_checkpoint(folder, tag="t", load_optimizer_states=False)
    check_plan(plans[0], recorded=False)  # DeepSpeed's files have no record
    reference = torch.load(f"{folder}/reference.pt", weights_only=True)["model"]
    mapped = _mapped(model, ep_size)
    for local_name, p, ref_name in mapped:
        assert_close(p.detach(), reference[ref_name], f"{local_name} loaded", 1e-5, 2e-5)
    engine.destroy()
    return len(mapped)


def expert_record_checked(folder: str) -> None:
    """The tag ``t`` saved at ep_size 2 on 2 ranks with the record of expert 3's first weight
    transposed: the rank holding expert 3 refuses it naming the tensor, the other stops too."""
    path = Path(folder) / "t" / "mp_rank_00_model_states.pt"
    record = torch.load(path, weights_only=True)[PLAN_KEY]
    held = next(f for f in record["files"] if f["name"].startswith("layer_0_expert_3_"))
    name = next(n for n, p in held["pieces"].items() if len(p["global_shape"]) == 2)
    if dist.get_rank() == 0:
        edit_record(path, transpose_recorded(name))
    dist.barrier()
    model = GPTMoE(TINY, MoEConfig(ep_size=2, num_experts=4, k=2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": dict(OPT_PARAMS)},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    holds = groups._get_expert_parallel_rank(groups.expert_group_name(2)) == 1  # experts 2, 3
    expected = (
        (CheckpointPlanError, f"tensor '{re.escape(name)}' is saved in")
        if holds
        else (RuntimeError, "another rank failed to load checkpoint")
    )
    try:
        engine.load_checkpoint(folder, tag="t")
    except expected[0] as error:
        assert re.search(expected[1], str(error)), error
    else:
        raise AssertionError("a record disagreeing with the experts' shapes was loaded")
    engine.destroy()
