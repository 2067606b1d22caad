"""Rank side of the AutoEP checkpoint test: an AutoEP model and the unmodified model trained
side by side, saved, and resumed (possibly at another ``autoep_size``, world or stage) in
parity."""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist

import shardspeed
from shardspeed.checkpoint.planner import MODULE
from tests.checkpoint.plan_spy import captured_plans, check_plan
from tests.moe.autoep.autoep_ranks import _local_slices, _tokens, build, section
from tests.runtime.parity import assert_close


def train_side_by_side(
    folder: str, stage: int, ep_size: int, steps: int, first_step: int, resume: bool
) -> list[float]:
    """Qwen3-MoE with AutoEP at ``ep_size`` and the plain model, ``steps`` steps from
    ``first_step``; ``resume``: both load ``folder`` first, else both save there after."""
    rank = dist.get_rank()
    reference = build("qwen3_moe")
    model = copy.deepcopy(reference)
    base: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
    }
    expert = {**base, "expert_parallel": section("qwen3_moe", ep_size=ep_size)}
    engine, *_ = shardspeed.initialize(model=model, config=expert)
    ref_engine, *_ = shardspeed.initialize(model=reference, config=base)
    if resume:
        with captured_plans() as plans:  # the one reader, checking the fused experts' rows
            engine.load_checkpoint(f"{folder}/autoep", tag="t")
            ref_engine.load_checkpoint(f"{folder}/plain", tag="t")
        for plan in plans:
            check_plan(plan)
        fused = [
            name for family, name in plans[0].sources if family == MODULE and "experts" in name
        ]
        assert fused and all(len(plans[0].sources[(MODULE, n)]) > 1 for n in fused), fused
    slices = _local_slices(engine.module)
    ref_params = dict(ref_engine.module.named_parameters())

    def compare(what: str) -> None:
        for name, param in engine.module.named_parameters():
            expected = ref_params[name].detach()
            if name in slices:
                expected = expected[slices[name]]
            assert_close(param.detach(), expected, f"{name} {what}", 1e-5, 1e-5)

    compare("after load" if resume else "at start")
    losses = []
    for step in range(first_step, first_step + steps):
        ids = _tokens(rank, step % 2, 2, 6)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref_engine(input_ids=ids, labels=ids).loss
        ref_engine.backward(ref_loss)
        ref_engine.step()
        assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}", 1e-5, 1e-6)
        compare(f"at step {step}")
        losses.append(loss.item())
    if not resume:
        engine.save_checkpoint(f"{folder}/autoep", tag="t")
        ref_engine.save_checkpoint(f"{folder}/plain", tag="t")
        engine.save_16bit_model(folder, "autoep16.pt")  # the fused rows gathered and stacked
        ref_engine.save_16bit_model(folder, "plain16.pt")
    engine.destroy()
    ref_engine.destroy()
    return losses


def stale_parameters() -> str:
    """A parameter list built before initialize is refused (AutoEP replaced its experts); a
    lazy ``model.parameters()`` is fine."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "expert_parallel": section("qwen3_moe"),
    }
    model = build("qwen3_moe")
    try:
        shardspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("a stale parameter list was accepted")
    model = build("qwen3_moe")
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    engine.destroy()
    return message
