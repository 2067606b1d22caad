"""Fine-tune a small Llama-architecture model with the Hugging Face ``Trainer`` on shardspeed.

Needs ``transformers`` and ``accelerate`` and the ``deepspeed`` compatibility package
(``pip install ./compat/deepspeed``). The model is built from a config and the text is a few
sentences in this file, read as bytes (vocabulary 256), so nothing is downloaded. The DeepSpeed
config (``--deepspeed``, default ``examples/configs/hf_llama_zero3.json``) is the kind HF users
write, with ``"auto"`` wherever the Trainer fills the value in. Under ZeRO-3 the model is
partitioned while it is built (the ``TrainingArguments`` exist first, so ``from_config`` runs
inside ``zero.Init``); ``save_model`` gathers it into ``OUTPUT/final/model.safetensors``,
which ``from_pretrained`` loads anywhere::

    shardspeed --num_gpus 2 examples/hf_llama_finetune.py          # on CPU: 2 processes
    torchrun --nproc_per_node 2 examples/hf_llama_finetune.py     # the same
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

HERE = Path(__file__).resolve().parent
TEXT = (
    "ZeRO partitions the optimizer states, then the gradients, then the parameters across the "
    "data-parallel ranks, so each rank keeps a slice of the model and gathers the rest only "
    "while a layer runs. The engine scales the loss, reduces the gradients bucket by bucket and "
    "steps the optimizer on its own shard. A checkpoint holds every rank's partition and can be "
    "loaded on another number of ranks. "
)


class ByteChunks(Dataset):
    """``TEXT`` repeated, cut into ``length``-byte chunks; each is its own label."""

    def __init__(self, length: int = 64, repeats: int = 8) -> None:
        data = torch.tensor(list((TEXT * repeats).encode()), dtype=torch.long)
        self.chunks = data[: len(data) // length * length].view(-1, length)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.chunks[index], "labels": self.chunks[index]}


def deepspeed_state_on_cpu() -> None:
    """Accelerate only picks a process-group backend for DeepSpeed when it sees a GPU; on a
    CPU-only machine, create its state with gloo first (and tell TrainingArguments to use it)."""
    from accelerate.state import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default=str(HERE / "configs" / "hf_llama_zero3.json"))
    parser.add_argument("--output_dir", default="runs/hf_llama")
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launchers
    args = parser.parse_args()

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        deepspeed_state_on_cpu()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        accelerator_config={"use_configured_state": on_cpu},
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        warmup_steps=3,
        logging_steps=max(1, min(5, args.max_steps // 2)),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=not on_cpu,
        seed=0,
    )
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    # after TrainingArguments: under ZeRO-3 the model is built partitioned (zero.Init)
    model = AutoModelForCausalLM.from_config(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=ByteChunks())
    result = trainer.train()
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"done: {result.global_step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"saved {final}/model.safetensors")


if __name__ == "__main__":
    main()
