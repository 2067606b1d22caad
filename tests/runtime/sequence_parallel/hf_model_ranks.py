"""Rank side of the Hugging Face model tests: a tiny Llama / Qwen2 with the registered
``"ulysses"`` attention, fed this rank's slice of the tokens and positions, gives the whole
model's logits slice, and the gradients summed over the sequence-parallel ranks equal the whole
sequence's in one process."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_utils import AttentionInterface

from shardspeed.comm.parallel_topology import set_current_topology
from shardspeed.runtime.sequence_parallel import parallel_state_sp
from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from shardspeed.utils import groups
from tests.runtime.parity import assert_close

BATCH, VOCAB = 2, 64
ARCHS: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def reset() -> None:
    """Leave the pool's ranks as they were: no sequence-parallel topology, no "ulysses"."""
    parallel_state_sp.parallel_topology = None
    set_current_topology(None)
    AttentionInterface._global_mapping.pop("ulysses", None)


def _cleaned(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    finally:
        reset()


def _config(arch: str, core: str, q_heads: int, kv_heads: int) -> Any:
    config_cls, _ = ARCHS[arch]
    return config_cls(
        vocab_size=VOCAB,
        hidden_size=8 * q_heads,
        head_dim=8,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        attn_implementation=core,
    )


def _model_equals_whole(arch: str, core: str, q_heads: int, kv_heads: int) -> str:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    whole = ARCHS[arch][1](_config(arch, core, q_heads, kv_heads)).float()
    sharded = copy.deepcopy(whole)
    mpu = UlyssesSPAttentionHF.register_with_transformers(sharded, core, world, BATCH)
    assert mpu is parallel_state_sp
    assert sharded.config._attn_implementation == "ulysses"
    assert whole.config._attn_implementation == core

    mode = ""
    for length in (6 * world, 4 * world):  # the length changes between steps
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, VOCAB, (BATCH, length), generator=gen)
        positions = torch.arange(length).unsqueeze(0).expand(BATCH, -1)
        whole.zero_grad()
        sharded.zero_grad()
        logits = whole(input_ids=ids, position_ids=positions).logits
        weight = torch.randn(logits.shape, generator=gen)
        (logits * weight).sum().backward()

        s = length // world
        rows = slice(rank * s, (rank + 1) * s)
        mine = sharded(input_ids=ids[:, rows], position_ids=positions[:, rows]).logits
        assert_close(mine, logits[:, rows], "logits", 1e-5, 1e-5)
        (mine * weight[:, rows]).sum().backward()
        group = mpu.get_sequence_parallel_group()
        for (name, p), (_, q) in zip(
            sharded.named_parameters(), whole.named_parameters(), strict=True
        ):
            assert p.grad is not None and q.grad is not None, name
            summed = p.grad.clone()
            dist.all_reduce(summed, group=group)
            assert_close(summed, q.grad, f"grad {name}", 1e-5, 1e-5)
        layer = sharded.model.layers[0].self_attn
        mode = AttentionInterface._global_mapping["ulysses"].ulysses.layout.mode
        assert layer.num_key_value_groups == q_heads // kv_heads
    return mode


def model_equals_whole(arch: str, core: str, q_heads: int, kv_heads: int) -> str:
    result: str = _cleaned(_model_equals_whole, arch, core, q_heads, kv_heads)
    return result


def _groups_match(sp: int) -> dict[str, Any]:
    """register_with_transformers given a config path: the mpu's groups are the ones
    ``shardspeed.utils.groups`` answers with, and a model loaded with
    ``attn_implementation="ulysses"`` runs through the wrapper."""
    config = _config("llama", "sdpa", 4, 2)
    with tempfile.TemporaryDirectory() as path:
        config.save_pretrained(path)
        mpu = UlyssesSPAttentionHF.register_with_transformers(path, "sdpa", sp, 1)
        loaded = AutoConfig.from_pretrained(path, attn_implementation="ulysses")
    model = AutoModelForCausalLM.from_config(loaded, attn_implementation="ulysses")
    assert model.config._attn_implementation == "ulysses"

    def ranks(group: Any) -> list[int]:
        return list(dist.get_process_group_ranks(group or dist.group.WORLD))

    assert ranks(mpu.get_sequence_parallel_group()) == ranks(groups._get_sequence_parallel_group())
    assert ranks(mpu.get_data_parallel_group()) == ranks(groups._get_data_parallel_group())
    assert ranks(mpu.get_sequence_data_parallel_group()) == ranks(
        groups._get_sequence_data_parallel_group()
    )
    assert mpu.get_sequence_parallel_world_size() == groups._get_sequence_parallel_world_size()
    assert mpu.get_sequence_parallel_rank() == groups._get_sequence_parallel_rank()
    # the wrapper runs: a forward on this rank's slice of 2 tokens per rank
    ids = torch.arange(2 * sp).unsqueeze(0) % VOCAB
    sp_rank = mpu.get_sequence_parallel_rank()
    rows = slice(2 * sp_rank, 2 * sp_rank + 2)
    out = model(input_ids=ids[:, rows], position_ids=torch.arange(2 * sp)[rows].unsqueeze(0))
    assert out.logits.shape == (1, 2, VOCAB)
    return {
        "sp_ranks": ranks(mpu.get_sequence_parallel_group()),
        "dp_ranks": ranks(mpu.get_data_parallel_group()),
        "sp_size": mpu.get_sequence_parallel_world_size(),
        "dp_size": mpu.get_data_parallel_world_size(),
    }


def groups_match(sp: int) -> dict[str, Any]:
    result: dict[str, Any] = _cleaned(_groups_match, sp)
    return result


def _registration_error(case: str) -> str:
    """The error text of a bad call (every rank raises the same one)."""
    world = dist.get_world_size()
    model = LlamaForCausalLM(_config("llama", "sdpa", 4, 4))
    calls: dict[str, Callable[[], Any]] = {
        "sp_not_dividing": lambda: UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", world + 1, 1
        ),
        "core": lambda: UlyssesSPAttentionHF.register_with_transformers(
            model, "flash_attention_2", world, 1
        ),
        "fixed_without_length": lambda: UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", world, 1, seq_length=None, seq_length_is_variable=False
        ),
        "length_not_dividing": lambda: UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", world, 1, seq_length=world + 1, seq_length_is_variable=False
        ),
    }
    try:
        calls[case]()
    except ValueError as error:
        assert model.config._attn_implementation == "sdpa"  # nothing changed
        return str(error)
    raise AssertionError(f"{case}: no error")


def registration_error(case: str) -> str:
    result: str = _cleaned(_registration_error, case)
    return result


def sp_one_is_a_no_op() -> bool:
    model = LlamaForCausalLM(_config("llama", "sdpa", 4, 4))
    result = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, 1)
    return result is None and model.config._attn_implementation == "sdpa"


def _disable_in_eval(core: str) -> bool:
    """With disable_in_eval, an eval-mode model attends within each rank's slice alone: the
    logits equal the whole model run on that slice by itself."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    whole = LlamaForCausalLM(_config("llama", core, 4, 2)).float().eval()
    sharded = copy.deepcopy(whole)
    UlyssesSPAttentionHF.register_with_transformers(sharded, core, world, 1, disable_in_eval=True)
    ids = torch.randint(0, VOCAB, (1, 4 * world), generator=torch.Generator().manual_seed(1))
    rows = slice(4 * rank, 4 * rank + 4)
    positions = torch.arange(4 * world).unsqueeze(0)[:, rows]
    with torch.no_grad():
        alone = whole(input_ids=ids[:, rows], position_ids=positions).logits
        mine = sharded(input_ids=ids[:, rows], position_ids=positions).logits
    assert_close(mine, alone, "eval logits", 1e-5, 1e-6)
    return True


def disable_in_eval(core: str) -> bool:
    result: bool = _cleaned(_disable_in_eval, core)
    return result
