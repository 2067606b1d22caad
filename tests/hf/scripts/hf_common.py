"""What the Hugging Face test scripts share: the tiny Llama, its data, the DeepSpeed configs, and
the one step Accelerate needs on a machine without a GPU.

Run as scripts (``tests/hf/scripts`` is ``sys.path[0]``), under any launcher that sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

SEQ_LEN = 16
SAMPLES = 32
VOCAB = 256


class RandomTokens(Dataset):
    """``SAMPLES`` fixed random token sequences; each is its own label (causal LM)."""

    def __init__(self, samples: int = SAMPLES, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ_LEN), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def eval_batch() -> torch.Tensor:
    """A fixed batch, not in the training data, that every run scores the trained model on."""
    return RandomTokens(samples=4, seed=1).tokens


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )


def ds_config(stage: int, config_optimizer: bool) -> dict[str, Any]:
    """A DeepSpeed config as HF users write it: ``"auto"`` wherever the Trainer fills a value.

    ``config_optimizer``: DeepSpeed builds the optimizer from the config (its params ``"auto"``
    too); otherwise the Trainer passes its own AdamW.
    """
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": "auto",
        "wall_clock_breakdown": False,
    }
    if config_optimizer:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    return config


def deepspeed_state_on_cpu() -> None:
    """Create Accelerate's process state for DeepSpeed with the gloo backend.

    Accelerate only picks a process-group backend for DeepSpeed when it sees a GPU (or another
    device); on a CPU-only machine it would count one process. Creating the state first with
    ``backend="gloo"`` (and ``TrainingArguments(accelerator_config={"use_configured_state":
    True})``) gives it the real world size. Nothing to do where a GPU is present.
    """
    if torch.cuda.is_available():
        return
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def forget_run() -> None:
    """Drop what one sub-case leaves in process-wide state before the next one starts."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    gc.collect()


def shard_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameter storage this rank holds now, against the whole model's."""
    held = full = 0
    for param in model.parameters():
        size = param.element_size()
        full += int(getattr(param, "ds_numel", param.numel())) * size
        shard = getattr(param, "ds_tensor", None)
        held += param.untyped_storage().nbytes()
        if shard is not None:
            held += shard.numel() * shard.element_size()
    return {"held": held, "full": full}


@torch.no_grad()
def score(model: Any) -> float:
    """The causal-LM loss of ``model`` (an engine, a DDP wrapper or a plain model) on
    :func:`eval_batch`; every rank must call it under ZeRO-3 (the forward gathers)."""
    tokens = eval_batch()
    was_training = model.training
    model.eval()
    loss = model(input_ids=tokens, labels=tokens).loss
    model.train(was_training)
    return float(loss)


def arguments(*extra: tuple[str, dict[str, Any]]) -> argparse.Namespace:
    """``OUT`` plus ``extra`` (name, add_argument keywords); ``--local_rank`` is accepted, as the
    deepspeed launchers pass it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--local_rank", type=int, default=None)
    for name, options in extra:
        parser.add_argument(name, **options)
    return parser.parse_args()


def start(out: Path) -> Path:
    """Join the process group (gloo) and save the initial tiny Llama once; its folder."""
    from transformers import LlamaForCausalLM

    from shardspeed import comm

    torch.set_num_threads(1)
    comm.init_distributed(dist_backend="gloo")
    init_dir = out / "init"
    if comm.get_rank() == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config()).save_pretrained(str(init_dir))
    comm.barrier()
    return init_dir


def run_cases(default: str, run_case: Any) -> None:
    """The scripts' main: ``OUT [--cases a,b]``; join the group, save the initial model, run
    ``run_case(name, OUT, init_dir)`` for each case in order and write each rank's result to
    ``OUT/<case>/rank<R>.json``."""
    from shardspeed import comm

    opts = arguments(("--cases", {"default": default}))
    init_dir = start(opts.out)
    rank = comm.get_rank()
    for name in opts.cases.split(","):
        (opts.out / name).mkdir(parents=True, exist_ok=True)
        result = run_case(name, opts.out, init_dir)
        write_json(opts.out / name / f"rank{rank}.json", result)
    print(json.dumps({"rank": rank, "done": opts.cases}), flush=True)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
