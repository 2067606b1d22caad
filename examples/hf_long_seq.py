"""Train a small Llama on sequences split over 2 ranks: DeepSpeed's ALST sequence parallelism
(Ulysses attention, the sequence-splitting data loader, the token-weighted loss) on shardspeed.

The model is built from a config and the data is random tokens, so nothing is downloaded. Each
rank holds half of every 512-token sequence; ZeRO-3 shards the model over both ranks::

    shardspeed --num_gpus 2 examples/hf_long_seq.py          # on CPU: 2 processes
    shardspeed --num_gpus 2 examples/hf_long_seq.py --tiled  # MLP and loss over tiles

``--tiled`` computes every MLP with ``TiledMLP`` and the head and loss with
``TiledFusedLogitsLoss`` (the same losses, less memory for long sequences).
"""

from __future__ import annotations

import argparse
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import shardspeed
from shardspeed.runtime.sequence_parallel.loss import sequence_parallel_loss
from shardspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)
from shardspeed.utils import groups

SP = 2
SEQ = 512
VOCAB = 1024


def tile_mlps(model: Any, shards: int) -> None:
    """Each decoder MLP computed over ``shards`` tiles of the sequence."""
    for layer in model.model.layers:
        original = type(layer.mlp).forward

        def forward(self: Any, x: torch.Tensor, _fn: Any = original) -> torch.Tensor:
            return TiledMLP.apply(_fn, self, x, shards, list(self.parameters()))

        layer.mlp.forward = types.MethodType(forward, layer.mlp)


def tiled_loss(model: Any, hidden: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """The head and cross-entropy over 4 tiles: the mean over the tokens that count."""

    def head_loss(head: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(x).float()
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-100)

    head = model.lm_head
    return TiledFusedLogitsLoss.apply(
        head_loss, head, hidden, shift_labels, None, 4, list(head.parameters()), "mean"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiled", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()

    shardspeed.init_distributed()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=SP,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    if args.tiled:
        tile_mlps(model, shards=2)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu
    )
    # a repeating pattern the model can learn: token t+1 follows token t
    start = torch.randint(0, VOCAB, (args.steps * engine.dp_world_size,))
    rows = [{"input_ids": (s + torch.arange(SEQ)) % VOCAB} for s in start]
    for row in rows:
        row["labels"] = row["input_ids"]
    loader = DataLoader(rows, batch_size=1)  # this rank's batches (one sequence each)
    loader = UlyssesSPDataLoaderAdapter(
        loader,
        sp_rank=groups._get_sequence_parallel_rank(),
        sp_group=groups._get_sequence_parallel_group(),
        sp_world_size=SP,
        device=engine.device,
    )
    sp_group = groups._get_sequence_parallel_group()
    losses = []
    for step, batch in enumerate(loader):
        ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["shift_labels"]
        if args.tiled:
            hidden = engine.module.model(input_ids=ids, position_ids=positions)
            loss = tiled_loss(engine.module, hidden.last_hidden_state, labels)
        else:
            logits = engine(input_ids=ids, position_ids=positions).logits
            loss = model.loss_function(
                logits=logits, labels=None, shift_labels=labels, vocab_size=VOCAB
            )
        loss = sequence_parallel_loss(loss, labels, sp_group)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if step + 1 == args.steps:
            break
    if engine.global_rank == 0:
        print(
            f"done: {len(losses)} steps of {SEQ}-token sequences split over {SP} ranks, "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
