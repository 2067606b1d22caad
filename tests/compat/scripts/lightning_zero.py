"""Lightning's ``DeepSpeedStrategy`` on shardspeed, then Lightning's own converter of its checkpoint.

Run by ``tests/compat/test_lightning.py`` under ``torchrun`` (2 ranks on CPU, gloo), with the
``deepspeed`` compatibility package importable. For each ZeRO stage given: a Lightning ``Trainer``
fine-tunes a tiny Llama (tied input/output embeddings, built from a config), saves with
``trainer.save_checkpoint`` (DeepSpeed's directory layout), and every rank scores the trained
model. Rank 0 then converts the checkpoint with
``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict``, loads the
file into a fresh module and scores it, and writes the weights with
``deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict`` too. Results go to
``OUT/stage<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ, SAMPLES = 128, 8, 16


class Tokens(Dataset):
    """Fixed random token rows; each is its own label."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def build_module() -> Any:
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    class TinyLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                max_position_embeddings=32,
                tie_word_embeddings=True,
            )
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    return TinyLlama()


@torch.no_grad()
def score(module: Any) -> float:
    """The loss of ``module`` on a batch outside the training data (every rank under ZeRO-3)."""
    tokens = Tokens(4, seed=1).rows
    was_training = module.training
    module.eval()
    loss = float(module.model(input_ids=tokens, labels=tokens).loss)
    module.train(was_training)
    return loss


def run_stage(stage: int, out: Path) -> None:
    import deepspeed
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning refuses DeepSpeed on anything but CUDA (and checks CUDA device indices);
        shardspeed runs on the CPU: the same steps, less those two checks."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    module = build_module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CPUDeepSpeedStrategy(stage=stage),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(Tokens(SAMPLES, seed=0), batch_size=2))
    ckpt = out / f"stage{stage}.ckpt"
    trainer.save_checkpoint(ckpt)
    trained = score(module)
    result: dict[str, Any] = {"trained": trained, "files": sorted(os.listdir(ckpt / "checkpoint"))}
    if trainer.global_rank == 0:
        converted = out / f"stage{stage}.pt"
        client = convert_zero_checkpoint_to_fp32_state_dict(ckpt, converted)
        fresh = build_module()
        torch.manual_seed(1)
        for param in fresh.parameters():  # nothing of the initial weights may survive
            torch.nn.init.normal_(param)
        saved = torch.load(converted, weights_only=False)
        fresh.load_state_dict(saved["state_dict"])
        result["converted"] = score(fresh)
        result["client_keys"] = sorted(client)
        result["global_step"] = saved["global_step"]
        # DeepSpeed's converter into HF-style weight files: pickle keeps tied weights tied
        deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            ckpt, out / f"stage{stage}-bin"
        )
        deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            ckpt, out / f"stage{stage}-safe", safe_serialization=True
        )
        (out / f"stage{stage}.json").write_text(json.dumps(result, indent=1))
    trainer.strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stages", default="2,3")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for stage in (int(s) for s in args.stages.split(",")):
        run_stage(stage, args.out)


if __name__ == "__main__":
    main()
