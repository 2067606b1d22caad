"""The HF ``Trainer`` with DeepSpeed sequence parallelism (ALST) on shardspeed:
``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))``
on 2 ranks, so the two ranks split every sequence and form one data-parallel rank, against
plain DDP (no sequence parallelism) on the same global batches.

Usage: ``<launcher> trainer_sp_cases.py OUT [--cases ddp,sp_z2,sp_z3]``.

What the Trainer does with sequence parallelism, through the compatibility package:
Accelerate calls ``UlyssesSPAttentionHF.register_with_transformers`` (the model's attention
becomes Ulysses over the 2 ranks) and passes its ``mpu`` to ``deepspeed.initialize``; the
Trainer wraps its data loader in ``UlyssesSPDataLoaderAdapter`` (every rank's batch is served
to both ranks in turn, each taking its half of the sequence, with pre-shifted labels) and
combines the shard losses weighted by their tokens. Each rank's loader yields one sample per
micro-step, which the adapter makes 2 micro-steps (its own sample, then the other rank's), so
``gradient_accumulation_steps`` 4 covers the same 4 samples as DDP's 2 ranks x 2 micro-steps.
Every sample has all its tokens counted, so DDP's mean of per-sample means is the same loss.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from hf_common import (
    RandomTokens,
    deepspeed_state_on_cpu,
    ds_config,
    forget_run,
    run_cases,
)

from shardspeed import comm

MAX_STEPS = 4
SP = 2
#: case -> ZeRO stage (None: plain DDP)
CASES: dict[str, int | None] = {"ddp": None, "sp_z2": 2, "sp_z3": 3}


def training_args(out: Path, stage: int | None) -> Any:
    from transformers import TrainingArguments

    extra: dict[str, Any] = {}
    if stage is None:
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    else:
        from accelerate.utils import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        deepspeed_state_on_cpu()
        extra["deepspeed"] = ds_config(stage, config_optimizer=False)
        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=SP,
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
            ),
        )
    return TrainingArguments(
        output_dir=str(out),
        use_cpu=stage is None,
        accelerator_config={
            "use_configured_state": stage is not None and not torch.cuda.is_available()
        },
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2 if stage is None else 2 * SP,
        max_steps=MAX_STEPS,
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        weight_decay=0.01,
        adam_epsilon=1e-3,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        **extra,
    )


def whole_parameters(trainer: Any, stage: int | None) -> dict[str, torch.Tensor]:
    model = trainer.model
    if stage is None:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    from shardspeed.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_case(name: str, root: Path, init_dir: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM, Trainer

    stage = CASES[name]
    case_dir = root / name
    args = training_args(case_dir / "run", stage)
    model = LlamaForCausalLM.from_pretrained(str(init_dir))
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train()
    result: dict[str, Any] = {
        "case": name,
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "engine": type(trainer.model_wrapped).__name__,
        "attn": model.config._attn_implementation,
    }
    if stage is not None:
        engine = trainer.model_wrapped
        result["sp_size"] = engine.topology.size("sp")
        result["dp_size"] = engine.topology.size("dp")
        result["train_batch_size"] = engine.train_batch_size()
    params = whole_parameters(trainer, stage)
    if comm.get_rank() == 0:
        torch.save(params, case_dir / "params.pt")
    del trainer, model
    forget_run()
    return result


if __name__ == "__main__":
    run_cases(",".join(CASES), run_case)
