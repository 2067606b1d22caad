"""Rank side of the ZeRO-3 expert-parallel tests: the GPT-MoE (DeepSpeed's ``MoE`` layer) and a
Qwen3-MoE made expert-parallel by AutoEP, trained at ZeRO stage 3 against a single-process
``ep_size=1`` reference, saved, and resumed in other configurations."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from shardspeed.ops.factory import build_optimizer
from shardspeed.runtime.zero.partition_parameters import GatheredParameters
from tests.moe import ep_ranks
from tests.moe.autoep.autoep_ranks import VOCAB, _local_slices, build, section
from tests.runtime.parity import assert_close

#: ZeRO-3 with every parameter sharded and gathered around its use (nothing persistent) and the
#: 16-bit weights gathered by ``save_16bit_model``
ZERO3: dict[str, Any] = {
    "stage": 3,
    "reduce_bucket_size": 2000,
    "stage3_param_persistence_threshold": 0,
    "stage3_gather_16bit_weights_on_model_save": True,
}


def gpt(
    stage: int, ep_size: int, threshold: int = 0, leaf_moe: bool = False, **kwargs: Any
) -> list[float]:
    """``ep_ranks.engine_parity`` (the GPT-MoE against its single-process ``ep_size=1`` copy,
    step by step) at ZeRO ``stage``; at stage 3 parameters of ``threshold`` elements or more
    are sharded and gathered around their use, the smaller ones kept whole. ``leaf_moe``: each
    MoE layer is one ZeRO-3 leaf, gathered whole: its gate (data parallel) and its experts
    (expert-data parallel) in one unit."""
    extra = None
    if stage == 3:
        zero = {**ZERO3, "stage3_param_persistence_threshold": threshold}
        if leaf_moe:
            zero["leaf_module"] = {"classes": ["MoE"]}
        extra = {"zero_optimization": zero}
    return ep_ranks.engine_parity(stage, ep_size, config_extra=extra, **kwargs)


# -- AutoEP -----------------------------------------------------------------------------------
FAMILY = "qwen3_moe"
#: sequences per step over all ranks, and their length
GLOBAL_BATCH, LENGTH = 4, 6
CLIP = 0.5
OPT = {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}


def _tokens(step: int) -> torch.Tensor:
    """The global batch of ``step``: two batches in turn, so the loss falls."""
    gen = torch.Generator().manual_seed(1000 + step % 2)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=gen)


def _reference_step(model: torch.nn.Module, optimizer: Any, ids: torch.Tensor, world: int) -> Any:
    """One step of the unmodified model on the whole global batch, as ``world`` data-parallel
    ranks see it (each micro-batch's loss, router aux loss included, averaged): (loss, norm)."""
    optimizer.zero_grad()
    micro = GLOBAL_BATCH // world
    total = torch.zeros(())
    for rank in range(world):
        part = ids[rank * micro : (rank + 1) * micro]
        loss = model(input_ids=part, labels=part).loss
        loss.backward()
        total += loss.detach()
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(world)
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
    optimizer.step()
    return total / world, norm


def autoep(
    stage: int,
    ep_size: int,
    steps: int,
    first_step: int = 0,
    save_dir: str | None = None,
    load_dir: str | None = None,
    partitioned: bool = False,
) -> list[float]:
    """Qwen3-MoE with AutoEP at ``ep_size`` under ZeRO ``stage``, against the unmodified model
    in one process on the same global batch (split into this world's micro-batches): losses,
    gradient norm (clipped) and every parameter (a local expert slice against its rows) agree
    at every step. ``partitioned``: the model is partitioned by ``zero.Init`` before
    ``initialize`` (AutoEP slices the fused experts of a partitioned model). ``load_dir``: both
    resume from there first; ``save_dir``: both save there after. Returns the global losses."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = build(FAMILY)
    model = copy.deepcopy(reference)
    if partitioned:
        shardspeed.zero.Init(module=model)
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": dict(OPT)},
        "zero_optimization": ZERO3 if stage == 3 else {"stage": stage},
        "expert_parallel": section(FAMILY, ep_size=ep_size),
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    ref_opt = build_optimizer("AdamW", list(reference.parameters()), OPT)
    if load_dir is not None:
        engine.load_checkpoint(load_dir, tag="t")
        saved = torch.load(f"{load_dir}/reference.pt", weights_only=True)
        reference.load_state_dict(saved["model"])
        ref_opt.load_state_dict(saved["optimizer"])
    slices = _local_slices(engine.module)
    assert slices, "AutoEP replaced nothing"
    ref_params = dict(reference.named_parameters())

    def compare(what: str) -> None:
        with GatheredParameters(list(engine.module.parameters())):  # ZeRO-3: whole here
            for name, param in engine.module.named_parameters():
                expected = ref_params[name].detach()
                if name in slices:
                    expected = expected[slices[name]]
                # experts' gradients sum in another order than the dense model's; Adam turns
                # that fp32 noise into ~2e-6 on near-zero weights after 10 steps
                assert_close(param.detach(), expected, f"{name} {what}", 1e-5, 1e-5)

    compare("after load" if load_dir else "at start")
    losses, norms = [], []
    micro = GLOBAL_BATCH // world
    for step in range(first_step, first_step + steps):
        ids = _tokens(step)
        rows = ids[rank * micro : (rank + 1) * micro]
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
        ref_loss, ref_norm = _reference_step(reference, ref_opt, ids, world)
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total / world, ref_loss, f"loss at step {step}", 1e-5, 1e-6)
        norm = engine.get_global_grad_norm()
        assert norm is not None
        assert_close(torch.tensor(norm), ref_norm, f"gradient norm at step {step}", 1e-5, 0)
        compare(f"at step {step}")
        losses.append(float(total / world))
        norms.append(float(ref_norm))
    assert max(norms) > CLIP, norms  # clipping took part
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t")
        engine.save_16bit_model(save_dir, "model16.pt")  # the fused rows gathered and stacked
        if rank == 0:
            state = {"model": reference.state_dict(), "optimizer": ref_opt.state_dict()}
            torch.save(state, f"{save_dir}/reference.pt")
        dist.barrier()
    engine.destroy()
    return losses
