"""Rank side of the engine's sequence-parallel tests: a model whose attention splits the
sequence over the ``sp`` ranks (a toy one on ``DistributedAttention``, or a Hugging Face model
whose attention ``UlyssesSPAttentionHF`` replaced), trained by the engine with ZeRO over the
data- and sequence-parallel ranks, step by step against one process on the whole sequences of
the same global batch.

Each sequence-parallel rank computes the loss of its shard and the ranks combine them as
DeepSpeed's ALST tutorial (and Hugging Face's Trainer) do: a differentiable all-gather of the
shard losses weighted by their good (not -100) tokens."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.comm.parallel_topology import current_topology
from shardspeed.runtime.sequence_parallel.loss import sequence_parallel_loss
from shardspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
from shardspeed.sequence.layer import DistributedAttention
from shardspeed.utils import groups
from shardspeed.zero import GatheredParameters

VOCAB, SEQ, MICRO = 64, 16, 2
OPT = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}


class ToyAttentionModel(nn.Module):
    """Embedding, one causal attention block (4 heads) and an untied head. With
    ``sequence_parallel`` its attention runs through ``DistributedAttention`` over the job's
    sequence-parallel group (looked up at forward: the engine builds it)."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Embedding(SEQ, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB)
        self.sequence_parallel = False
        #: the MLP through ``TiledMLP`` and the head and loss through ``TiledFusedLogitsLoss``
        self.tiled = False

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))

    @staticmethod
    def _head_loss(head: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = head(x)
        return F.cross_entropy(
            logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=-100
        )

    @staticmethod
    def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [seq, batch, heads, dim] -> sdpa's [batch, heads, seq, dim] and back
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor
    ) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)  # [batch, seq, hidden]
        b, s, h = x.shape
        q, k, v = self.qkv(x).transpose(0, 1).reshape(s, b, 3, self.heads, -1).unbind(2)
        if self.sequence_parallel:
            attention = DistributedAttention(self._core, groups._get_sequence_parallel_group())
            context = attention(q, k, v)
        else:
            context = self._core(q, k, v)
        x = x + self.out(context.reshape(s, b, h).transpose(0, 1))
        if not self.tiled:
            return self._head_loss(self.head, self.norm(x + self._mlp(x)), shift_labels)
        mlp_params = [*self.up.parameters(), *self.down.parameters()]
        x = x + TiledMLP.apply(type(self)._mlp, self, x, 3, mlp_params)
        return TiledFusedLogitsLoss.apply(
            self._head_loss, self.head, self.norm(x), shift_labels, None, 3,
            list(self.head.parameters()), "mean",
        )  # fmt: skip


def shift_labels_of(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted left by one over the whole sequence (the last position -100)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def sp_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group: Any) -> torch.Tensor:
    """DeepSpeed's tutorial aggregation: every shard's loss weighted by its good tokens. Its
    own code (torch's differentiable all-gather) where that runs: on gloo torch's backward
    fails for a group without global rank 0, so those groups use shardspeed's."""
    if 0 not in dist.get_process_group_ranks(group):
        return sequence_parallel_loss(loss, shift_labels, group)
    losses = torch.stack(dist_nn.all_gather(loss, group=group))
    good = (shift_labels != -100).sum()
    counts = torch.stack(dist_nn.all_gather(good, group=group))
    losses = torch.where(counts > 0, losses, torch.zeros_like(losses))
    return (losses * counts).sum() / counts.sum().clamp(min=1)


def batches(steps: int, rows: int, seed: int = 1, masked: bool = True) -> torch.Tensor:
    """Token ids and labels (``[steps, 2, rows, SEQ]``); with ``masked`` each row's prompt (a
    random-length prefix, sometimes longer than one shard) is -100 in the labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps, rows, SEQ), generator=gen)
    labels = ids.clone()
    if masked:
        prompt = torch.randint(0, SEQ - 2, (steps, rows), generator=gen)
        labels[torch.arange(SEQ) < prompt[..., None]] = -100
    return torch.stack([ids, labels], dim=1)


def full_parameters(engine: Any) -> dict[str, torch.Tensor]:
    model = engine.module
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone().float() for n, p in model.named_parameters()}


def train_and_compare(
    build: Callable[[], nn.Module],
    forward: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    prepare: Callable[[nn.Module, int], Any],
    sp: int,
    stage: int,
    steps: int = 10,
    gas: int = 1,
    clip: float = 1.0,
    extra: dict[str, Any] | None = None,
    masked: bool = True,
) -> dict[str, Any]:
    """``steps`` optimizer steps of ``build()`` at ``sp`` sequence-parallel ranks x the rest
    data parallel, ZeRO ``stage``, against the same model on whole sequences in this process.

    ``prepare(model, sp)`` turns sequence parallelism on (it returns the ``mpu`` to pass, or
    None to let the config's ``sequence_parallel_size`` build the groups); ``forward(model,
    batch)`` gives the loss of ``batch`` (``input_ids``, ``position_ids``, ``shift_labels``).
    Returns the worst relative differences of the losses and of every parameter, and the
    first step's gradient difference."""
    world = dist.get_world_size()
    dp = world // sp
    model = build()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), **OPT)
    mpu = prepare(model, sp)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": dict(OPT)},
        "zero_optimization": {"stage": stage},
    }
    if mpu is None:
        config["sequence_parallel_size"] = sp
    for key, value in (extra or {}).items():
        config[key] = {**config[key], **value} if key in config else value
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=mpu
    )
    topo = current_topology()
    assert topo.size("sp") == sp and topo.size("dp") == dp, topo.sizes
    assert engine.dp_world_size == dp and engine.train_batch_size() == MICRO * gas * dp
    dp_rank, sp_rank = topo.local_rank("dp"), topo.local_rank("sp")
    sp_group = groups._get_sequence_parallel_group()
    shard = SEQ // sp
    data = batches(steps, MICRO * dp * gas, masked=masked)
    worst_loss = worst_param = 0.0
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    for step in range(steps):
        ids, labels = data[step]
        losses = []
        for micro in range(gas):
            rows = slice((micro * dp + dp_rank) * MICRO, (micro * dp + dp_rank + 1) * MICRO)
            cut = slice(sp_rank * shard, (sp_rank + 1) * shard)
            batch = {
                "input_ids": ids[rows, cut],
                "position_ids": positions[:, cut],
                "shift_labels": shift_labels_of(labels[rows])[:, cut].contiguous(),
            }
            loss = sp_loss(forward(engine, batch), batch["shift_labels"], sp_group)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        mean /= world
        ref_opt.zero_grad()
        ref_total = 0.0
        for micro in range(gas):
            replica_losses = []
            for replica in range(dp):
                rows = slice((micro * dp + replica) * MICRO, (micro * dp + replica + 1) * MICRO)
                whole = {
                    "input_ids": ids[rows],
                    "position_ids": positions,
                    "shift_labels": shift_labels_of(labels[rows]),
                }
                replica_losses.append(forward(reference, whole))
            ref_loss = torch.stack(replica_losses).mean() / gas
            ref_loss.backward()
            ref_total += float(ref_loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        worst_loss = max(worst_loss, abs(float(mean) - ref_total) / abs(ref_total))
        got = full_parameters(engine)
        for name, want in reference.named_parameters():
            diff = (got[name] - want.detach()).abs().max() / want.detach().abs().max()
            worst_param = max(worst_param, float(diff))
        if not math.isfinite(worst_param):
            break
    return {"loss": worst_loss, "param": worst_param}


# ---------------------------------------------------------------- the toy model
def _toy_prepare(model: nn.Module, sp: int) -> Any:
    model.sequence_parallel = True  # type: ignore[assignment]
    return None


def _toy_prepare_mpu(model: nn.Module, sp: int) -> Any:
    """DeepSpeed's mpu path: ``parallel_state_sp`` made first, handed to ``initialize``."""
    from shardspeed.runtime.sequence_parallel import parallel_state_sp

    model.sequence_parallel = True  # type: ignore[assignment]
    parallel_state_sp.initialize_sequence_parallel(sp)
    return parallel_state_sp


def _tiled(prepare: Callable[[nn.Module, int], Any], model: nn.Module, sp: int) -> Any:
    model.tiled = True  # type: ignore[assignment]
    return prepare(model, sp)


def _toy_forward(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch)


def toy_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every ``train_and_compare`` keyword set in ``cases`` on the toy attention model."""
    out = []
    for case in cases:
        case = dict(case)
        prepare = _toy_prepare_mpu if case.pop("via", "config") == "mpu" else _toy_prepare
        if case.pop("tiled", False):
            prepare = functools.partial(_tiled, prepare)
        torch.manual_seed(0)
        out.append(train_and_compare(ToyAttentionModel, _toy_forward, prepare, **case))
    return out


# ---------------------------------------------------------------- Hugging Face models
def tiny_hf_model(kind: str, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """A two-layer Llama (untied head) or Qwen2 (biased q/k/v, tied head) from a config;
    ``heads`` query heads of width 8 and ``kv_heads`` key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=8 * heads,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))


def _hf_prepare(model: nn.Module, sp: int) -> Any:
    """DeepSpeed's ALST set-up: the attention registered with Transformers, its mpu passed."""
    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sp,
        micro_batch_size=MICRO,
        seq_length=SEQ,
        seq_length_is_variable=True,
    )


def _hf_forward(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = batch["shift_labels"]
    return model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        labels=labels,
        shift_labels=labels,
    ).loss


def hf_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every ``train_and_compare`` keyword set in ``cases`` (plus ``kind``, ``heads``,
    ``kv_heads``) on a Hugging Face model with ``UlyssesSPAttentionHF``."""
    out = []
    for case in cases:
        case = dict(case)
        kind, heads, kv = case.pop("kind"), case.pop("heads", 4), case.pop("kv_heads", 2)
        build = functools.partial(tiny_hf_model, kind, heads, kv)
        out.append(train_and_compare(build, _hf_forward, _hf_prepare, **case))
    return out
