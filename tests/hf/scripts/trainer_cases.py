"""The HF ``Trainer`` on a tiny Llama: plain DDP, then DeepSpeed (shardspeed) at ZeRO 2 and 3.

Usage: ``<launcher> trainer_cases.py OUT [--cases ddp,z2,z3[,launcher_z3]] [--config-file]``.
One process group serves every sub-case, in order. Each sub-case builds ``TrainingArguments``
first and only then ``from_pretrained`` (so under ZeRO-3 ``HfDeepSpeedConfig`` makes
``zero.Init`` partition the model while it loads), grows the vocabulary
(``resize_token_embeddings``), trains ``MAX_STEPS`` steps with a checkpoint every
``SAVE_STEPS``, scores the trained model (and ``evaluate()``s it), ``save_model()``s it, and
trains again from a fresh load resuming from the first checkpoint. Each rank writes ``OUT/<case>/rank<R>.json``.

``--config-file``: hand ``TrainingArguments`` a JSON file path instead of a dict.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from hf_common import (
    VOCAB,
    RandomTokens,
    arguments,
    deepspeed_state_on_cpu,
    ds_config,
    forget_run,
    score,
    shard_bytes,
    start,
    write_json,
)

from shardspeed import comm

EXTRA_TOKENS = 8
MAX_STEPS = 4
SAVE_STEPS = 2
#: case -> (ZeRO stage or None for plain DDP, DeepSpeed builds the optimizer from the config)
CASES: dict[str, tuple[int | None, bool]] = {
    "ddp": (None, False),
    "z2": (2, False),
    "z3": (3, True),
    # DeepSpeed from `accelerate launch --use_deepspeed --deepspeed_config_file`, not the args
    "launcher_z3": (3, True),
}


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
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        logging_steps=1,
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        weight_decay=0.01,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        save_only_model=False,
    )


def grow_vocabulary(model: Any) -> None:
    """``resize_token_embeddings`` by ``EXTRA_TOKENS`` (under ZeRO-3 it gathers the old
    embedding and head to copy them); the new rows come from the same seed in every case."""
    torch.manual_seed(1)
    model.resize_token_embeddings(VOCAB + EXTRA_TOKENS, mean_resizing=False)


def losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def run_case(name: str, root: Path, init_dir: Path, config_file: bool) -> dict[str, Any]:
    from transformers import LlamaForCausalLM, Trainer

    stage, config_optimizer = CASES[name]
    case_dir = root / name
    deepspeed: Any = None
    if name == "launcher_z3":
        assert os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"), "needs accelerate launch"
    elif stage is not None:
        deepspeed = ds_config(stage, config_optimizer)
        if config_file:
            path = case_dir / "ds_config.json"
            if comm.get_rank() == 0:
                write_json(path, deepspeed)
            comm.barrier()
            deepspeed = str(path)
    result: dict[str, Any] = {"case": name, "stage": stage}

    args = training_args(case_dir / "run", stage, deepspeed)
    model = LlamaForCausalLM.from_pretrained(str(init_dir))
    result["loaded_bytes"] = shard_bytes(model)
    grow_vocabulary(model)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train()
    result["losses"] = losses(trainer)
    result["score"] = score(trainer.model_wrapped)
    result["eval_loss"] = trainer.evaluate(RandomTokens(samples=8, seed=2))["eval_loss"]
    result["engine"] = type(trainer.model_wrapped).__name__
    trainer.save_model(str(case_dir / "final"))
    del trainer, model
    forget_run()

    args = training_args(case_dir / "resumed", stage, deepspeed)
    model = LlamaForCausalLM.from_pretrained(str(init_dir))
    grow_vocabulary(model)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train(resume_from_checkpoint=str(case_dir / "run" / f"checkpoint-{SAVE_STEPS}"))
    result["resumed_losses"] = losses(trainer)
    result["resumed_score"] = score(trainer.model_wrapped)
    del trainer, model
    forget_run()
    return result


def main() -> None:
    opts = arguments(
        ("--cases", {"default": "ddp,z2,z3"}),
        ("--config-file", {"action": "store_true"}),
    )
    init_dir = start(opts.out)
    rank = comm.get_rank()
    launched_by = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    for name in opts.cases.split(","):
        result = run_case(name, opts.out, init_dir, opts.config_file)
        result["env"] = launched_by
        write_json(opts.out / name / f"rank{rank}.json", result)
    print(json.dumps({"rank": rank, "done": opts.cases}), flush=True)


if __name__ == "__main__":
    main()
