"""A Hugging Face ``Trainer`` script that ``shardspeed --autotuning`` tunes through
``arg_mappings``: its batch comes from ``--per_device_train_batch_size`` and
``--gradient_accumulation_steps``, and activation checkpointing from ``--gradient_checkpointing``
(given only when on), which the autotuner sets per experiment; the AutoTP size, when tuned,
comes in the config (``tensor_parallel.autotp_size``). Rank 0 prints what it got."""

from __future__ import annotations

import argparse
import json

from hf_common import RandomTokens, deepspeed_state_on_cpu, llama_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    on_cpu = not torch.cuda.is_available()
    deepspeed_state_on_cpu()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        accelerator_config={"use_configured_state": on_cpu},
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_checkpointing=args.gradient_checkpointing,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    if training_args.process_index == 0:
        with open(args.deepspeed) as fd:
            tp = json.load(fd).get("tensor_parallel", {}).get("autotp_size", 0)
        print(
            f"hf batch {args.per_device_train_batch_size} accum {args.gradient_accumulation_steps}"
            f" checkpointing {args.gradient_checkpointing} autotp {tp}",
            flush=True,
        )
    model = AutoModelForCausalLM.from_config(llama_config())
    Trainer(model=model, args=training_args, train_dataset=RandomTokens(samples=64)).train()


if __name__ == "__main__":
    main()
