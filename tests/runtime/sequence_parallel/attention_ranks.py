"""Rank side of the sequence-parallel attention tests: each rank attends with its slice of
the sequence, and the output slice and the q/k/v gradients must equal attention over the whole
sequence in one process (torch sdpa, fp32)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from shardspeed.runtime.sequence_parallel import parallel_state_sp
from shardspeed.runtime.sequence_parallel.attention_hf import (
    UlyssesSPAttentionHF,
    eager_core_attention,
)
from tests.runtime.parity import assert_close

BATCH, DIM = 2, 8
CORES = {"sdpa": sdpa_attention_forward, "eager": eager_core_attention}


class FakeAttention(nn.Module):
    """What the core reads from an HF attention module."""

    def __init__(self, q_heads: int, kv_heads: int, causal: bool) -> None:
        super().__init__()
        self.is_causal = causal
        self.num_key_value_groups = q_heads // kv_heads
        self.scaling = DIM**-0.5


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=DIM**-0.5)


def _case(
    layer: UlyssesSPAttentionHF, q_heads: int, kv_heads: int, causal: bool, length: int, seed: int
) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, q_heads, length, DIM, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(BATCH, kv_heads, length, DIM, generator=gen, requires_grad=True) for _ in "kv"
    )
    expected = _whole(q, k, v, causal).transpose(1, 2)  # [b, L, h, d]
    weight = torch.randn(expected.shape, generator=gen)
    (expected * weight).sum().backward()

    s = length // world
    rows = slice(rank * s, (rank + 1) * s)
    mine = [t.detach()[:, :, rows].clone().requires_grad_(True) for t in (q, k, v)]
    positions = torch.arange(length)[rows].unsqueeze(0).expand(BATCH, -1)
    module = FakeAttention(q_heads, kv_heads, causal)
    out, _ = layer(module, *mine, None, position_ids=positions, dropout=0.0, scaling=DIM**-0.5)
    assert out.shape == (BATCH, s, q_heads * DIM), out.shape
    assert module.num_key_value_groups == q_heads // kv_heads  # restored after the core
    want = expected[:, rows].reshape(BATCH, s, -1)
    assert_close(out, want, "output", 1e-5, 1e-6)
    (out * weight[:, rows].reshape(BATCH, s, -1)).sum().backward()
    for name, local, whole in zip("qkv", mine, (q, k, v), strict=True):
        assert local.grad is not None and whole.grad is not None
        assert_close(local.grad, whole.grad[:, :, rows], f"d{name}", 1e-5, 1e-6)
    return (out - want).abs().max().item()


def attention_equals_whole(q_heads: int, kv_heads: int, lengths: list[int]) -> str:
    """Every core x causal x sequence length (one layer per core: the length varies between its
    calls); returns the layout's mode."""
    world = dist.get_world_size()
    parallel_state_sp.initialize_sequence_parallel(world)
    group = parallel_state_sp.get_sequence_parallel_group()
    mode = ""
    for core_name, core in CORES.items():
        layer = UlyssesSPAttentionHF(
            core, BATCH, q_heads, DIM, kv_heads, 2, group, seq_length_is_variable=True
        )
        layer.core_attn_implementation = core_name
        mode = layer.layout.mode
        for causal in (True, False):
            for seed, length in enumerate(lengths):
                _case(layer, q_heads, kv_heads, causal, length * world, seed)
    return mode


def fixed_length_checked() -> str:
    """seq_length_is_variable=False takes only slices of local_seq_length."""
    world = dist.get_world_size()
    parallel_state_sp.initialize_sequence_parallel(world)
    layer = UlyssesSPAttentionHF(
        sdpa_attention_forward,
        BATCH,
        4,
        DIM,
        4,
        1,
        parallel_state_sp.get_sequence_parallel_group(),
        seq_length_is_variable=False,
        local_seq_length=4,
        global_seq_length=4 * world,
    )
    layer.core_attn_implementation = "sdpa"
    x = torch.randn(BATCH, 4, 4, DIM)
    pos = torch.arange(4).unsqueeze(0) + 4 * dist.get_rank()
    out, _ = layer(FakeAttention(4, 4, True), x, x, x, None, position_ids=pos)
    assert out.shape == (BATCH, 4, 4 * DIM)
    y = torch.randn(BATCH, 4, 3, DIM)
    try:
        layer(FakeAttention(4, 4, True), y, y, y, None, position_ids=pos[:, :3])
    except AssertionError as error:
        assert isinstance(error, ValueError)
        return str(error)
    raise AssertionError("a slice of the wrong length was accepted")


def position_ids_required() -> str:
    world = dist.get_world_size()
    parallel_state_sp.initialize_sequence_parallel(world)
    layer = UlyssesSPAttentionHF(
        sdpa_attention_forward,
        1,
        4,
        DIM,
        4,
        1,
        parallel_state_sp.get_sequence_parallel_group(),
        seq_length_is_variable=True,
    )
    x = torch.randn(1, 4, 2, DIM)
    try:
        layer(FakeAttention(4, 4, True), x, x, x, None)
    except AssertionError as error:
        return str(error)
    raise AssertionError("a call without position_ids was accepted")


def packed_documents(core_name: str, q_heads: int) -> str:
    """Packed rows (positions restarting): the eager core keeps documents apart exactly;
    sdpa and ring attention refuse them. Returns "exact" or the error text."""
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_state_sp.initialize_sequence_parallel(world)
    layer = UlyssesSPAttentionHF(
        CORES[core_name],
        1,
        q_heads,
        DIM,
        q_heads,
        1,
        parallel_state_sp.get_sequence_parallel_group(),
        seq_length_is_variable=True,
    )
    layer.core_attn_implementation = core_name
    length = 4 * world
    cut = length // 2 + 1  # the second document starts inside a slice
    positions = torch.cat([torch.arange(cut), torch.arange(length - cut)]).unsqueeze(0)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, q_heads, length, DIM, generator=gen) for _ in "qkv")
    expected = torch.cat(
        [
            _whole(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], True),
            _whole(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], True),
        ],
        dim=2,
    ).transpose(1, 2)
    rows = slice(rank * 4, rank * 4 + 4)
    try:
        out, _ = layer(
            FakeAttention(q_heads, q_heads, True),
            *(t[:, :, rows] for t in (q, k, v)),
            None,
            position_ids=positions[:, rows],
            scaling=DIM**-0.5,
        )
    except RuntimeError as error:
        return str(error)
    assert_close(out, expected[:, rows].reshape(1, 4, -1), "packed output", 1e-5, 1e-6)
    return "exact"


def subgroup_ranks(ulysses: int) -> tuple[list[int], list[int]]:
    """Global ranks of this rank's (Ulysses group, ring group) from the topology."""
    parallel_state_sp.initialize_sequence_parallel(dist.get_world_size())
    topology = parallel_state_sp.parallel_topology
    assert topology is not None
    u_group, r_group = topology.sequence_subgroups(ulysses)
    return (
        list(dist.get_process_group_ranks(u_group or dist.group.WORLD)),
        list(dist.get_process_group_ranks(r_group or dist.group.WORLD)),
    )
