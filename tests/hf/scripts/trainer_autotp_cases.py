"""The HF ``Trainer`` on a tiny Llama split by AutoTP (``tensor_parallel.autotp_size`` 2 on 2
ranks, so one data-parallel rank), against plain DDP on the same global batches.

Usage: ``<launcher> trainer_autotp_cases.py OUT [--cases ddp,tp_z1,tp_z3]``.
One process group serves every sub-case, in order. Each loads the tiny Llama built from its
config and saved once (``OUT/init``) with ``from_pretrained``, trains ``MAX_STEPS`` steps,
``save_model()``s it to ``OUT/<case>/final`` and writes ``OUT/<case>/rank<R>.json`` (losses, the engine's class, the shapes of this rank's
pieces); rank 0 also writes the engine's parameters, gathered whole, to
``OUT/<case>/engine_params.pt`` (DDP: its own parameters).

The DDP reference takes one sample per rank and micro-step, the AutoTP runs two on their one
data-parallel rank: the same 2 samples per micro-step, 2 micro-steps per optimizer step.

Where the model is loaded: after ``TrainingArguments``, as HF scripts do, except at ZeRO-3:
there the Trainer's live DeepSpeed config would make ``from_pretrained`` load into
``zero.Init`` partitions, which Transformers refuses under DeepSpeed tensor parallelism (and
AutoTP splits whole weights), so it is loaded before.
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
TP = 2
#: case -> (ZeRO stage or None for plain DDP, load the model before TrainingArguments)
CASES: dict[str, tuple[int | None, bool]] = {
    "ddp": (None, False),
    "tp_z1": (1, False),
    "tp_z3": (3, True),
}


def autotp_config(stage: int) -> dict[str, Any]:
    """The HF-style ``"auto"`` config with ``tensor_parallel.autotp_size`` and the 16-bit save
    gather on (Accelerate saves AutoTP weights only with it)."""
    config = ds_config(stage, config_optimizer=False)
    config["tensor_parallel"] = {"autotp_size": TP}
    return config


def training_args(out: Path, stage: int | None, deepspeed: Any) -> Any:
    from transformers import TrainingArguments

    if stage is not None:
        deepspeed_state_on_cpu()
    else:  # the reference runs without DeepSpeed even under `accelerate launch --use_deepspeed`
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    return TrainingArguments(
        output_dir=str(out),
        deepspeed=deepspeed,
        use_cpu=stage is None,
        accelerator_config={
            "use_configured_state": stage is not None and not torch.cuda.is_available()
        },
        # the same 2 samples per micro-step: one on each DDP rank, both on the one TP group
        per_device_train_batch_size=1 if stage is None else 2,
        gradient_accumulation_steps=2,
        max_steps=MAX_STEPS,
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        weight_decay=0.01,
        # Adam divides by sqrt(v) + eps: a larger eps keeps the comparison about the split,
        # not about float noise in near-zero second moments
        adam_epsilon=1e-3,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )


def load_model(init_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(init_dir))


def whole_parameters(trainer: Any, stage: int | None) -> dict[str, torch.Tensor]:
    """The trained parameters, whole: the engine's gathered over ZeRO-3 and the
    tensor-parallel group (every rank calls it), or the DDP model's own."""
    model = trainer.model
    if stage is None:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    from shardspeed.runtime.tensor_parallel.gather import whole_state_dict
    from shardspeed.zero import GatheredParameters

    engine = trainer.model_wrapped
    with GatheredParameters(list(model.parameters())):
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
    return whole_state_dict(model, local, engine.tensor_parallel.group)


def run_case(name: str, root: Path, init_dir: Path) -> dict[str, Any]:
    from transformers import Trainer

    stage, before_args = CASES[name]
    case_dir = root / name
    deepspeed = None if stage is None else autotp_config(stage)
    model = load_model(init_dir) if before_args else None
    args = training_args(case_dir / "run", stage, deepspeed)
    if model is None:
        model = load_model(init_dir)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train()
    result: dict[str, Any] = {
        "case": name,
        "stage": stage,
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "engine": type(trainer.model_wrapped).__name__,
        "local_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
    }
    if stage is not None:
        engine = trainer.model_wrapped
        result["tp_size"] = engine.topology.size("tp")
        result["dp_size"] = engine.topology.size("dp")
    params = whole_parameters(trainer, stage)
    if comm.get_rank() == 0:
        torch.save(params, case_dir / "engine_params.pt")
    trainer.save_model(str(case_dir / "final"))
    del trainer, model
    forget_run()
    return result


if __name__ == "__main__":
    run_cases(",".join(CASES), run_case)
