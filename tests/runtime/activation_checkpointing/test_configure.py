"""configure(): config sources, overrides, checks; CPU checkpointing, contiguous buffer, sync."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import shardspeed.checkpointing as ckpt
from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.activation_checkpointing import partition, state
from tests.runtime.activation_checkpointing.models import assert_same, count_saved, deep_mlp

SECTION = {
    "partition_activations": True,
    "cpu_checkpointing": True,
    "contiguous_memory_optimization": True,
    "number_checkpoints": 3,
    "synchronize_checkpoint_boundary": True,
    "profile": False,
}


def test_unconfigured_defaults_and_is_configured() -> None:
    assert not ckpt.is_configured()
    ckpt.configure(None)
    assert ckpt.is_configured()
    cfg = state.settings()
    assert not (cfg.partition_activations or cfg.cpu_checkpointing or cfg.synchronize)


@pytest.mark.parametrize("source", ["dict", "path", "object"])
def test_config_sources(source: str, tmp_path: Path) -> None:
    full = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": SECTION}
    if source == "path":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(full))
        given: object = str(path)
    elif source == "object":
        given = DeepSpeedConfig(full)
    else:
        given = {"activation_checkpointing": SECTION}  # a partial dict is fine
    ckpt.configure(None, deepspeed_config=given)
    cfg = state.settings()
    assert (cfg.partition_activations, cfg.cpu_checkpointing) == (True, True)
    assert (cfg.contiguous_memory_optimization, cfg.num_checkpoints, cfg.synchronize) == (
        True,
        3,
        True,
    )


def test_call_arguments_override_config() -> None:
    ckpt.configure(
        None,
        deepspeed_config={"activation_checkpointing": SECTION},
        contiguous_checkpointing=False,
        checkpoint_in_cpu=False,
        num_checkpoints=8,
        synchronize=False,
        profile=True,
    )
    cfg = state.settings()
    assert cfg.partition_activations and not cfg.contiguous_memory_optimization
    assert (cfg.cpu_checkpointing, cfg.num_checkpoints, cfg.synchronize, cfg.profile) == (
        False,
        8,
        False,
        True,
    )
    ckpt.partition_activations_in_checkpoint(False)
    ckpt.set_num_layers(4)
    assert (cfg.partition_activations, cfg.num_checkpoints) == (False, 4)


def test_bad_settings_are_explained() -> None:
    with pytest.raises(ValueError, match="needs partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="number_checkpoints"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="partition_activation"):  # unknown key names the fix
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"partition": True}})
    with pytest.raises(TypeError, match="deepspeed_config"):
        ckpt.configure(None, deepspeed_config=3)


def _mlp_grads(
    count: bool = True, **options: object
) -> tuple[list[torch.Tensor], dict[str, object]]:
    torch.manual_seed(0)
    blocks = deep_mlp(16, 3, dropout=0.2)
    model = nn.Sequential(*blocks)
    if options:
        ckpt.configure(None, **options)
    torch.manual_seed(1)
    x = torch.randn(4, 16, requires_grad=True)
    # saved-tensor hooks bypass autograd's version checks: also run without them
    with count_saved(model) if count else contextlib.nullcontext({}) as saved:
        h = x
        for block in blocks:
            h = ckpt.checkpoint(block, h) if options else block(h)
    h.sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())], saved


def test_cpu_checkpointing_saves_on_host_and_grads_equal() -> None:
    reference, _ = _mlp_grads()
    got, saved = _mlp_grads(checkpoint_in_cpu=True)
    assert_same(reference, got)
    assert saved["devices"] == {"cpu"}
    stats = ckpt.get_stats()
    assert stats.offloaded_tensors == stats.saved_tensors == 3  # the offload path placed them
    assert stats.saved_devices == {"cpu"}


def test_contiguous_buffer_holds_partitions_and_slots_come_back() -> None:
    reference, _ = _mlp_grads()
    got, saved = _mlp_grads(
        partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3
    )
    assert_same(reference, got)
    buffers = partition.contiguous_buffers()
    assert buffers.allocated_bytes() == 3 * 4 * 16 * 4  # 3 slots of a 4x16 fp32 partition
    assert saved["bytes"] == 3 * 4 * 16 * 4
    assert ckpt.get_stats().partitioned_tensors == 3
    # every slot was released by its recompute: a second forward fits again
    got_again, _ = _mlp_grads(
        count=False, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3
    )
    assert_same(reference, got_again)


def test_contiguous_buffer_overflow_names_the_fix() -> None:
    ckpt.configure(
        None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1
    )
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    ckpt.checkpoint(lin, x)
    with pytest.raises(RuntimeError, match="number_checkpoints"):
        ckpt.checkpoint(lin, x)
    ckpt.reset()  # forwards without backward: reset frees the buffer
    ckpt.checkpoint(lin, x).sum().backward()


def test_synchronize_and_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardspeed.accelerator import get_accelerator

    accel = get_accelerator()
    calls: list[int] = []
    monkeypatch.setattr(accel, "synchronize", lambda device_index=None: calls.append(1))
    ckpt.configure(None, synchronize=True, profile=True)
    lin = nn.Linear(4, 4)
    ckpt.checkpoint(lin, torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert len(calls) == 4  # before and after the forward and the recompute
    stats = ckpt.get_stats()
    assert stats.forward_seconds > 0 and stats.recompute_seconds > 0


def test_slots_taken_before_reset_do_not_return_into_new_buffers() -> None:
    ckpt.configure(
        None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1
    )
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    stale = ckpt.checkpoint(lin, x)
    ckpt.reset()
    fresh = ckpt.checkpoint(lin, x)  # takes the only slot of the new buffer
    stale.sum().backward()  # gives back a slot of the dropped buffer: must be ignored
    with pytest.raises(RuntimeError, match="is full"):
        ckpt.checkpoint(lin, x)
    fresh.sum().backward()
    ckpt.checkpoint(lin, x).sum().backward()
