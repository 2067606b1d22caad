"""Rank-side code of test_engine_data_efficiency.py (run on a one-rank pool): a small GPT, the
legacy seqlen curriculum and random-LTD through the engine, checkpoints, the curriculum loader."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from shardspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

VOCAB, SEQ, WIDTH, LAYERS = 16, 32, 32, 4


class Block(nn.Module):
    """Pre-LN causal self-attention + MLP; the mask comes as the ``attn_mask`` keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, WIDTH))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, LAYERS blocks, a head; returns the next-token loss."""

    def __init__(self, takes_seqlen: bool = True) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.seen_lengths: list[int] = []

    def forward(self, tokens: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        if curriculum_seqlen is not None and curriculum_seqlen < tokens.size(1):
            tokens = tokens[:, :curriculum_seqlen]  # seqlen curriculum: the model truncates
        self.seen_lengths.append(tokens.size(1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        s = inputs.size(1)
        x = self.tok(inputs) + self.pos(torch.arange(s))
        mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(inputs.size(0), 1, s, s)
        for block in self.blocks:
            x = block(x, attn_mask=mask)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1))


class NoSeqlenGPT(TinyGPT):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(tokens)


def batch(step: int, size: int = 4) -> torch.Tensor:
    """A learnable stream: each row counts up by a row-specific stride from a random start."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    stride = torch.randint(1, 3, (size, 1), generator=gen)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def config(
    legacy: dict[str, Any] | None = None, ltd: dict[str, Any] | None = None
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
    }
    if legacy is not None:
        cfg["curriculum_learning"] = {"enabled": True, "curriculum_type": "seqlen", **legacy}
    if ltd is not None:
        cfg["data_efficiency"] = {
            "enabled": True,
            "data_routing": {"enabled": True, "random_ltd": {"enabled": True, **ltd}},
        }
    return cfg


LTD = {
    "total_layer_num": LAYERS,
    "random_ltd_layer_num": 2,
    "random_ltd_layer_id": [1, 2],
    "model_mask_name": "attn_mask",
    "model_type": "decoder",
    "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {
        "min_value": 8,
        "max_value": SEQ - 1,
        "schedule_type": "fixed_linear",
        "schedule_config": {"require_steps": 6, "seq_per_step": 4},
    },
}


def _engine(cfg: dict[str, Any], model: nn.Module | None = None) -> Any:
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=model or TinyGPT(), config=cfg)
    return engine


def legacy_lengths(legacy: dict[str, Any], steps: int, custom: bool = False) -> list[int]:
    """The sequence length the model saw at each of ``steps`` training steps."""
    engine = _engine(config(legacy))
    if custom:
        engine.curriculum_scheduler_legacy.set_custom_get_difficulty(lambda step: 4 * step + 4)
    for step in range(steps):
        engine.backward(engine(batch(step)))
        engine.step()
    engine.eval()
    engine(batch(0))  # evaluation: no curriculum keyword, the whole sequence
    return list(engine.module.seen_lengths)


def legacy_without_keyword() -> str:
    legacy = {
        "min_difficulty": 8,
        "max_difficulty": SEQ,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8},
    }
    engine = _engine(config(legacy), NoSeqlenGPT())
    try:
        engine(batch(0))
    except TypeError as error:
        return str(error)
    return "no error"


def _kept_counter(engine: Any) -> dict[int, list[int]]:
    """Per block index: the token count each forward of the block saw."""
    seen: dict[int, list[int]] = {}
    for index, block in enumerate(engine.module.blocks):
        inner = block.random_ltd_layer if isinstance(block, RandomLayerTokenDrop) else block
        seen[index] = []
        inner.register_forward_pre_hook(lambda _m, args, i=index: seen[i].append(args[0].size(1)))
    return seen


def random_ltd_trains(steps: int) -> dict[str, Any]:
    engine = convert_to_random_ltd(_engine(config(ltd=LTD)), Block)
    seen = _kept_counter(engine)
    losses, scheduled = [], []
    for step in range(steps):
        loss = engine(batch(step))
        scheduled.append(engine.random_ltd_scheduler.get_current_seq())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "seen": seen,
        "scheduled": scheduled,
        "losses": losses,
        "state": engine.random_ltd_scheduler.state_dict(),
        "configured": [
            i for i, b in enumerate(engine.module.blocks) if b.random_ltd_scheduler is not None
        ],
    }


def dense_trains(steps: int) -> list[float]:
    engine = _engine(config())
    losses = []
    for step in range(steps):
        loss = engine(batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _run(engine: Any, steps: range) -> dict[str, Any]:
    out: dict[str, Any] = {"seen": [], "ltd": [], "losses": []}
    for step in steps:
        loss = engine(batch(step))
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        out["ltd"].append(copy.deepcopy(engine.random_ltd_scheduler.state_dict()))
        out["legacy"] = copy.deepcopy(engine.curriculum_scheduler_legacy.get_state())
    out["seen"] = list(engine.module.seen_lengths)
    return out


def resume(save_dir: str, stage: int) -> dict[str, Any]:
    legacy = {"min_difficulty": 8, "max_difficulty": SEQ, "schedule_type": "custom"}
    cfg = {**config(legacy, LTD), "zero_optimization": {"stage": stage}}

    def custom(step: int) -> int:
        return min(SEQ, 8 + 4 * step)

    def build() -> Any:
        engine = convert_to_random_ltd(_engine(cfg), Block)
        engine.curriculum_scheduler_legacy.set_custom_get_difficulty(custom)
        return engine

    first = build()
    _run(first, range(3))
    saved_ltd = copy.deepcopy(first.random_ltd_scheduler.state_dict())
    saved_legacy = copy.deepcopy(first.curriculum_scheduler_legacy.get_state())
    first.save_checkpoint(save_dir, tag="t3", client_state={"mine": 1})
    first.module.seen_lengths.clear()
    torch.manual_seed(123)  # the token draws use the global generator, which no checkpoint keeps
    unbroken = _run(first, range(3, 6))
    second = build()
    _, client = second.load_checkpoint(save_dir, tag="t3")
    restored = (
        second.random_ltd_scheduler.state_dict() == saved_ltd
        and second.curriculum_scheduler_legacy.get_state() == saved_legacy
    )
    torch.manual_seed(123)
    resumed = _run(second, range(3, 6))
    return {"unbroken": unbroken, "resumed": resumed, "restored": restored, "client": client}


def curriculum_loader(
    index_dir: str, save_dir: str, dataset: Any, metric: dict[str, Any]
) -> dict[str, Any]:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "data_efficiency": {
            "enabled": True,
            "seed": 3,
            "data_sampling": {
                "enabled": True,
                "num_epochs": 2,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": index_dir,
                    "curriculum_metrics": {"seqlen": metric},
                },
            },
        },
    }

    def build() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(2 * VOCAB, 4), nn.Flatten(), nn.Linear(64, 1))
        engine, _, loader, _ = shardspeed.initialize(model=model, config=cfg, training_data=dataset)
        return engine, loader

    engine, loader = build()
    posted: list[int] = []
    engine.set_data_post_process_func(
        lambda data, state: posted.append(state["current_difficulties"]["seqlen"]) or data
    )
    batches, difficulties = [], []
    it = iter(loader)
    for n in range(12):
        data = next(it)
        batches.append(data.tolist())
        difficulties.append(posted[-1])
        engine.backward(engine(data).float().mean())
        engine.step()
        if n == 5:
            engine.save_checkpoint(save_dir, tag="mid")
    engine2, loader2 = build()
    engine2.load_checkpoint(save_dir, tag="mid")
    it2 = iter(loader2)
    again = [next(it2).tolist() for _ in range(6)]
    return {
        "batches": batches,
        "difficulties": difficulties,
        "again": again,
        "kind": type(loader).__name__,
    }
