"""TRL's trainers with a ZeRO-3 reference model on shardspeed: DPO, KTO, GRPO and RLOO (``beta >
0``, generating through TRL's gathered path, ``ds3_gather_for_generation=True``), and TRL's
``unwrap_model_for_generation`` on its own (case ``unwrap``).

Usage: ``<launcher> trl_reference.py OUT [--cases dpo,kto,grpo,rloo,unwrap]`` (2 ranks, CPU, gloo, the
``deepspeed`` compatibility package importable). Rank 0 saves a tiny Llama and a word-level
tokenizer built locally (nothing is downloaded); each trainer loads the policy from that folder
under ZeRO-3 and builds its reference model from the same folder, which TRL's
``prepare_deepspeed`` wraps in a second engine with ``"zero_optimization.<key>"`` overrides at
the top level of its config. Each case trains 2 steps; each rank writes
``OUT/<case>/rank<R>.json`` with the logged metrics and what the reference engine was built with.
Case ``unwrap`` trains two ZeRO-3 engines side by side and generates with one of them in between
(see :func:`unwrap_case`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    if case == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        # generates through the same gathered path as GRPO (ds3_gather_for_generation=True)
        args = RLOOConfig(
            **kwargs, beta=0.1, num_generations=2, max_completion_length=4,
            ds3_gather_for_generation=True,
        )  # fmt: skip
        return RLOOTrainer(
            str(model_dir),
            reward_funcs=length_reward,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
        )
    from trl import GRPOConfig, GRPOTrainer

    if case == "grpo_default":  # TRL's defaults: its beta (no reference model), gathered generation
        args = GRPOConfig(**kwargs, num_generations=2, max_completion_length=4)
    else:
        # ds3_gather_for_generation=True (TRL's default): generate() runs on the gathered model
        # with the ZeRO-3 hooks taken off through engine.optimizer.parameter_offload
        args = GRPOConfig(
            **kwargs, beta=0.1, num_generations=2, max_completion_length=4,
            ds3_gather_for_generation=True,
        )  # fmt: skip
    return GRPOTrainer(
        str(model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )


@contextmanager
def counting(owner: Any, name: str) -> Iterator[list[int]]:
    """Count the calls of ``owner.name`` inside the block (the real function still runs)."""
    calls: list[int] = []
    original: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


def unwrap_case(model_dir: Path) -> dict[str, Any]:
    """TRL's ``unwrap_model_for_generation`` (gathering, the default) on a ZeRO-3 engine.

    Two engines train the same model on the same data; after the first step one of them
    generates greedily through TRL's function. The tokens are compared with the same weights
    gathered into a plain model generating in this process; then both engines train 2 more
    steps, whose losses and final weights are compared (generation changes nothing)."""
    import deepspeed
    import trl.models.utils as trl_utils
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers import AutoModelForCausalLM

    import shardspeed.comm as ss_comm

    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }  # fmt: skip
    engines = [
        deepspeed.initialize(
            model=AutoModelForCausalLM.from_pretrained(str(model_dir)), config=config
        )[0]
        for _ in range(2)
    ]
    rank = comm.get_rank()
    data = torch.randint(4, 4 + WORDS, (3, comm.get_world_size(), 2, 8),
                         generator=torch.Generator().manual_seed(0))  # fmt: skip

    def step(engine: Any, index: int) -> float:
        batch = data[index, rank]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    losses = [[step(engine, 0)] for engine in engines]
    generating = engines[0]
    reference = AutoModelForCausalLM.from_config(generating.module.config)
    with deepspeed.zero.GatheredParameters(list(generating.module.parameters())):
        reference.load_state_dict({k: v.clone() for k, v in generating.module.state_dict().items()})
    prompt = data[0, 0, :, :4]  # the same on every rank
    options = {"max_new_tokens": 6, "do_sample": False, "attention_mask": torch.ones_like(prompt)}
    expected = reference.generate(prompt, synced_gpus=False, **options)
    deepspeed_state_on_cpu()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    offload = generating.optimizer.parameter_offload
    hooks = [len(offload.forward_hooks)]
    with counting(trl_utils, "remove_hooks") as removed, counting(trl_utils, "add_hooks") as added:
        with trl_utils.unwrap_model_for_generation(generating, accelerator) as unwrapped:
            hooks.append(len(offload.forward_hooks))
            with counting(ss_comm, "all_gather_into_tensor") as gathers:
                tokens = unwrapped.generate(prompt, **options)
    hooks.append(len(offload.forward_hooks))
    for index in (1, 2):
        for engine, logged in zip(engines, losses, strict=True):
            logged.append(step(engine, index))
    weights = []
    for engine in engines:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights.append({k: v.clone() for k, v in engine.module.state_dict().items()})
    return {
        "tokens": tokens.tolist(),
        "expected": expected.tolist(),
        "hooks": hooks,
        "trl_calls": [len(removed), len(added)],
        "gathers_in_generate": len(gathers),
        "losses": losses,
        "weights_equal": all(torch.equal(weights[0][k], v) for k, v in weights[1].items()),
        "weights_moved": not torch.equal(
            weights[0]["lm_head.weight"], reference.state_dict()["lm_head.weight"]
        ),
    }


def run_case(case: str, root: Path, model_dir: Path) -> dict[str, Any]:
    if case == "unwrap":
        result = unwrap_case(model_dir)
        forget_run()
        return result
    import trl.models.utils as trl_utils

    trainer = trainer_for(case, model_dir, root / case)
    ref = getattr(trainer, "ref_model", None)
    result: dict[str, Any] = {"ref_engine": None if ref is None else type(ref).__name__}
    if ref is not None:
        zero = ref.config.zero_optimization
        result |= {
            "ref_stage": int(zero.stage),
            "ref_has_optimizer": ref.optimizer is not None,
            "ref_buckets": {
                "reduce_bucket_size": zero.reduce_bucket_size,
                "stage3_prefetch_bucket_size": zero.prefetch_bucket_size,
                "stage3_param_persistence_threshold": zero.param_persistence_threshold,
            },
        }
    with counting(trl_utils, "remove_hooks") as removed:
        trainer.train()
    result["hooks_removed"] = len(removed)  # GRPO's generate() took the gathered path
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
