"""TRL's trainers with a ZeRO-3 reference model on shardspeed: DPO, KTO and GRPO (``beta > 0``).

Usage: ``<launcher> trl_reference.py OUT [--cases dpo,kto,grpo]`` (2 ranks, CPU, gloo, the
``deepspeed`` compatibility package importable). Rank 0 saves a tiny Llama and a word-level
tokenizer built locally (nothing is downloaded); each trainer loads the policy from that folder
under ZeRO-3 and builds its reference model from the same folder, which TRL's
``prepare_deepspeed`` wraps in a second engine with ``"zero_optimization.<key>"`` overrides at
the top level of its config. Each case trains 2 steps; each rank writes
``OUT/<case>/rank<R>.json`` with the logged metrics and what the reference engine was built with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_common import arguments, deepspeed_state_on_cpu, ds_config, forget_run, write_json

from shardspeed import comm

HIDDEN = 32
WORDS = 60


def save_model_and_tokenizer(folder: Path) -> None:
    """A 2-layer Llama (vocab 64) and a word-level tokenizer for ``w0 .. w59``, saved in
    ``folder`` as ``from_pretrained`` reads them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(WORDS)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip
    tokenizer.save_pretrained(str(folder))
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=64,
        pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def words(generator: torch.Generator, count: int) -> str:
    picks = torch.randint(0, WORDS, (count,), generator=generator)
    return " ".join(f"w{int(i)}" for i in picks)


def datasets(case: str) -> Any:
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    rows = 8
    prompts = [words(generator, 4) for _ in range(rows)]
    if case == "dpo":
        chosen = [words(generator, 3) for _ in range(rows)]
        rejected = [words(generator, 3) for _ in range(rows)]
        return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    if case == "kto":
        completions = [words(generator, 3) for _ in range(rows)]
        labels = [i % 2 == 0 for i in range(rows)]
        return Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels})
    return Dataset.from_dict({"prompt": prompts})


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """GRPO's reward: completions with more words score higher."""
    return [float(len(c.split())) for c in completions]


def common_args(out: Path) -> dict[str, Any]:
    deepspeed_state_on_cpu()
    return {
        "output_dir": str(out),
        "deepspeed": ds_config(3, config_optimizer=False),
        "accelerator_config": {"use_configured_state": not torch.cuda.is_available()},
        "per_device_train_batch_size": 2,
        "max_steps": 2,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "seed": 0,
        "report_to": [],
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
        "save_strategy": "no",
        "bf16": False,  # TRL's configs default to bf16; fp32 on CPU
    }


def trainer_for(case: str, model_dir: Path, out: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    kwargs = common_args(out)
    data = datasets(case)
    if case == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**kwargs, beta=0.1, max_length=16)
        return DPOTrainer(str(model_dir), args=args, train_dataset=data, processing_class=tokenizer)
    if case == "kto":
        from trl import KTOConfig, KTOTrainer

        args = KTOConfig(**kwargs, beta=0.1, max_length=16)
        return KTOTrainer(str(model_dir), args=args, train_dataset=data, processing_class=tokenizer)
    from trl import GRPOConfig, GRPOTrainer

    # ds3_gather_for_generation=False: TRL's default gathers the whole model around generate()
    # and detaches DeepSpeed's ZeRO-3 hooks through optimizer internals shardspeed does not
    # have (optimizer.parameter_offload); without it every forward of generate() gathers
    args = GRPOConfig(
        **kwargs, beta=0.1, num_generations=2, max_completion_length=4,
        ds3_gather_for_generation=False,
    )  # fmt: skip
    return GRPOTrainer(
        str(model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )


def run_case(case: str, root: Path, model_dir: Path) -> dict[str, Any]:
    trainer = trainer_for(case, model_dir, root / case)
    ref = trainer.ref_model
    zero = ref.config.zero_optimization
    result: dict[str, Any] = {
        "ref_engine": type(ref).__name__,
        "ref_stage": int(zero.stage),
        "ref_has_optimizer": ref.optimizer is not None,
        "ref_buckets": {
            "reduce_bucket_size": zero.reduce_bucket_size,
            "stage3_prefetch_bucket_size": zero.prefetch_bucket_size,
            "stage3_param_persistence_threshold": zero.param_persistence_threshold,
        },
    }
    trainer.train()
    result["engine"] = type(trainer.model_wrapped).__name__
    result["logs"] = [h for h in trainer.state.log_history if "loss" in h]
    del trainer, ref
    forget_run()
    return result


def main() -> None:
    opts = arguments(("--cases", {"default": "dpo,kto,grpo"}))
    torch.set_num_threads(1)
    comm.init_distributed(dist_backend="gloo")
    model_dir = opts.out / "tiny"
    if comm.get_rank() == 0:
        save_model_and_tokenizer(model_dir)
    comm.barrier()
    for case in opts.cases.split(","):
        result = run_case(case, opts.out, model_dir)
        write_json(opts.out / case / f"rank{comm.get_rank()}.json", result)


if __name__ == "__main__":
    main()
