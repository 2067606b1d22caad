"""A small GPT whose feed-forward is a Mixture of Experts in every other block
(``shardspeed.moe.layer.MoE``), for the MoE examples, tests and benchmark.

``model(tokens, targets)`` returns the cross-entropy plus ``aux_loss_coef`` times the sum of the
MoE layers' load-balancing losses; ``model.last_aux`` holds that sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt_model import Block, CausalSelfAttention, GPTConfig
from shardspeed.moe.layer import MoE


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 4
    ep_size: int = 1
    k: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = False
    aux_loss_coef: float = 0.01
    #: an MoE feed-forward in blocks 1, 1 + every, ...
    every: int = 2


class MoEBlock(nn.Module):
    """A pre-norm block whose MLP is an MoE layer of ``num_experts`` copies of the MLP."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        expert = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.moe = MoE(
            cfg.n_embd,
            expert,
            num_experts=moe.num_experts,
            ep_size=moe.ep_size,
            k=moe.k,
            capacity_factor=moe.capacity_factor,
            eval_capacity_factor=moe.capacity_factor,
            min_capacity=moe.min_capacity,
            drop_tokens=moe.drop_tokens,
            use_rts=moe.use_rts,
            top2_2nd_expert_sampling=False,
        )
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out, self.aux, _ = self.moe(self.ln2(x))
        return x + out


class GPTMoE(nn.Module):
    """The GPT of ``examples.gpt_model`` with MoE feed-forwards (untied head: an embedding
    used twice would be fine, but the MoE tests compare parameters one to one)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.cfg, self.moe_cfg = cfg, moe
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(
            MoEBlock(cfg, moe) if i % moe.every == 1 else Block(cfg) for i in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.last_aux = torch.zeros(())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x = block(x)
            if isinstance(block, MoEBlock):
                aux = aux + block.aux
        self.last_aux = aux.detach()
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return loss + self.moe_cfg.aux_loss_coef * aux


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """The name in an ``ep_size=1`` model of local parameter ``name`` on expert-parallel rank
    ``ep_rank`` (``...deepspeed_experts.<i>...`` -> ``<ep_rank * num_local + i>``)."""
    marker = "deepspeed_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker, 1)
    local, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * num_local + int(local)}.{rest}"
