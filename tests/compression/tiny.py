"""Tiny BERT (masked LM) and GPT-2 models trained through shardspeed's engine on learnable token
streams, for the compression tests: the losses a compressed model ends at are compared with the
dense model's. GPT-2 reads a fixed first-order Markov source (as ``tests.inference.models``
builds, over 32 tokens so that it learns in a hundred steps); BERT reads "topic" sequences
(each sequence's tokens mostly from one of 4 groups of 8), whose masked tokens a bidirectional
model learns to predict from the others quickly, where the Markov source leaves it on a long
plateau."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import transformers

import shardspeed
from shardspeed.compression import convert_conv1d_to_linear

VOCAB = 33  # token 0 is BERT's [MASK]; the streams use 1..32
BATCH, LENGTH = 16, 16
LR = 2e-3
MASK_ID = 0  # the stream's tokens are 1..VOCAB-1
MASK_RATE = 0.3


def structured_stream(batch: int, length: int, seed: int) -> torch.Tensor:
    """Sequences over tokens 1..VOCAB-1: each token is followed by its fixed successor with
    probability 0.8 and by a uniformly random token otherwise; ``seed`` picks the sequences."""
    successor = torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(1)) + 1
    draws = torch.Generator().manual_seed(seed)
    out = torch.empty(batch, length, dtype=torch.long)
    out[:, 0] = torch.randint(1, VOCAB, (batch,), generator=draws)
    for i in range(1, length):
        u = torch.rand(batch, generator=draws)
        uniform = torch.randint(1, VOCAB, (batch,), generator=draws)
        out[:, i] = torch.where(u < 0.8, successor[out[:, i - 1] - 1], uniform)
    return out


def topic_stream(batch: int, length: int, seed: int) -> torch.Tensor:
    """Sequences whose tokens come from one of 4 topics of 8 tokens each with probability 0.9
    (uniform over 1..32 otherwise); ``seed`` picks the topics and the tokens."""
    draws = torch.Generator().manual_seed(seed)
    topic = torch.randint(0, 4, (batch, 1), generator=draws)
    within = torch.randint(0, 8, (batch, length), generator=draws)
    uniform = torch.randint(1, VOCAB, (batch, length), generator=draws)
    on_topic = torch.rand(batch, length, generator=draws) < 0.9
    return torch.where(on_topic, 1 + topic * 8 + within, uniform)


def build(family: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A fresh tiny model (hidden 64, 4 heads, no dropout), the same weights per seed."""
    torch.manual_seed(seed)
    if family == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=LENGTH, type_vocab_size=1,
            initializer_range=0.1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return transformers.BertForMaskedLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=LENGTH,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        initializer_range=0.1,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    return convert_conv1d_to_linear(model, transformers.pytorch_utils.Conv1D)


def batch(family: str, seed: int) -> dict[str, torch.Tensor]:
    """One batch of the model's task: next-token prediction (GPT-2) or 15% masked tokens
    (BERT: ``MASK_RATE`` of the tokens), the same for the same seed."""
    if family != "bert":
        ids = structured_stream(BATCH, LENGTH, seed)
        return {"input_ids": ids, "labels": ids}
    ids = topic_stream(BATCH, LENGTH, seed)
    picks = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < MASK_RATE
    return {
        "input_ids": ids.masked_fill(picks, MASK_ID),
        "labels": ids.masked_fill(~picks, -100),
    }


def engine_config(compression: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "steps_per_print": 10_000,
    }
    if compression is not None:
        config["compression_training"] = compression
    return config


Hook = Callable[[Any, int], None]


def train(
    model: torch.nn.Module,
    family: str,
    steps: int,
    compression: dict[str, Any] | None = None,
    *,
    first_seed: int = 0,
    loss_fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor] | None = None,
    before_step: Hook | None = None,
) -> Any:
    """Train ``model`` for ``steps`` engine steps (one thread: tiny matmuls gain nothing from
    two on a shared machine); ``before_step(engine, step)`` sees each step's forward state."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine, *_ = shardspeed.initialize(model=model, config=engine_config(compression))
        engine.train()
        for step in range(steps):
            inputs = batch(family, 1000 + first_seed + step)
            if before_step is not None:
                before_step(engine, step)
            loss = engine(**inputs).loss if loss_fn is None else loss_fn(engine, inputs)
            engine.backward(loss)
            engine.step()
        return engine
    finally:
        torch.set_num_threads(threads)


def eval_loss(model: torch.nn.Module, family: str, batches: int = 4) -> float:
    """Mean loss over held-out batches (seeds no training step uses), eval mode."""
    model.eval()
    with torch.no_grad():
        losses = [model(**batch(family, 50 + i)).loss.item() for i in range(batches)]
    return sum(losses) / len(losses)


@functools.cache
def _dense_state(family: str, layers: int, steps: int) -> dict[str, torch.Tensor]:
    engine = train(build(family, layers), family, steps)
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def dense(family: str, layers: int = 2, steps: int = 100) -> torch.nn.Module:
    """The dense model after ``steps`` (cached: built once per session)."""
    model = build(family, layers)
    model.load_state_dict(_dense_state(family, layers, steps))
    return model


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)
