"""The engine's public verbs and queries on real ranks: accumulation boundary, no_sync, client
optimizer/scheduler overrides, the data loader's sharding, checkpoints and the 16-bit save."""

from __future__ import annotations

import copy
import itertools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import shardspeed
from shardspeed.runtime.dataloader import DeepSpeedDataLoader
from tests.runtime.parity import MLP, adamw_config


def _engine(config=None, **kwargs):
    torch.manual_seed(0)
    model = kwargs.pop("model", None) or MLP(width=8)
    engine, optimizer, loader, scheduler = shardspeed.initialize(
        model=model, config=config or adamw_config(2, 2, 0.0), **kwargs
    )
    return engine, optimizer, loader, scheduler


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)


def boundary_and_counters() -> None:
    engine, *_ = _engine()
    assert engine.get_batch_info() == (2 * 2 * dist.get_world_size(), 2, 2)
    assert [engine.is_gradient_accumulation_boundary()] == [False]
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(*_batch(0)))
    engine.step()  # micro-step 1 of 2: no update
    assert all(torch.equal(b, p) for b, p in zip(before, engine.module.parameters(), strict=True))
    assert engine.is_gradient_accumulation_boundary()
    engine.backward(engine(*_batch(1)))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1 and engine.micro_steps == 2
    assert engine.global_samples == engine.train_batch_size()
    assert any(
        not torch.equal(b, p) for b, p in zip(before, engine.module.parameters(), strict=True)
    )
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()
    engine.destroy()


def no_sync_matches_plain_accumulation() -> None:
    """no_sync on the first micro-step, a synced second: the same as plain accumulation."""
    plain, *_ = _engine()
    synced, *_ = _engine()
    rank = dist.get_rank()
    for micro in range(2):
        x, y = _batch(10 * rank + micro)
        plain.backward(plain(x, y))
        plain.step()
        if micro == 0:
            with synced.no_sync():
                synced.backward(synced(x, y))
        else:
            synced.backward(synced(x, y))
        synced.step()
    for p, q in zip(plain.module.parameters(), synced.module.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="nested"), synced.no_sync(), synced.no_sync():
        pass
    plain.destroy()
    synced.destroy()


def client_optimizer_and_scheduler_override_config() -> None:
    model = MLP(width=8)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    config = {
        **adamw_config(2, 1, 0.0),
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    }
    engine, optimizer, _, scheduler = _engine(
        config,
        model=model,
        optimizer=sgd,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )
    assert optimizer.optimizer is sgd
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert engine.get_lr() == [0.5] and engine.get_mom() == [0.9]
    engine.backward(engine(*_batch(0)))
    engine.step()
    assert engine.get_lr() == [0.25]
    # a callable optimizer gets the model parameters
    engine2, optimizer2, _, scheduler2 = _engine(
        adamw_config(2, 1, 0.0), optimizer=lambda params: torch.optim.SGD(params, lr=0.1)
    )
    assert isinstance(optimizer2.optimizer, torch.optim.SGD) and scheduler2 is None
    engine.destroy()
    engine2.destroy()


def config_scheduler_steps_with_the_optimizer() -> None:
    config = {
        **adamw_config(2, 2, 0.0),
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 0.1,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        },
    }
    engine, _, _, scheduler = _engine(config)
    lrs = [engine.get_lr()[0]]
    for micro in range(4):
        engine.backward(engine(*_batch(micro)))
        engine.step()
        lrs.append(engine.get_lr()[0])
    # the schedule moves once per optimizer step (every 2 micro-steps), not per micro-step; its
    # first step is iteration 0 (warmup_min_lr), as in DeepSpeed
    assert lrs[1] == lrs[0] and lrs[3] == lrs[2] == 0.0 and lrs[4] == pytest.approx(0.025)
    engine.destroy()


def dataloader_shards_the_dataset() -> list[int]:
    dataset = torch.utils.data.TensorDataset(torch.arange(20).float().unsqueeze(1))
    engine, _, loader, _ = _engine(adamw_config(2, 1, 0.0), training_data=dataset)
    assert isinstance(loader, DeepSpeedDataLoader)
    seen = [int(v) for (batch,) in loader for v in batch.flatten()]
    assert len(loader) == 5 and len(seen) == 10
    repeating = shardspeed.utils.RepeatingLoader(loader)
    assert sum(1 for _ in itertools.islice(repeating, 12)) == 12  # runs past the end of an epoch
    engine.destroy()
    return seen


def checkpoint_round_trip(save_dir: str) -> None:
    config = {**adamw_config(2, 1, 1.0), "fp16": {"enabled": True, "initial_scale_power": 10}}
    engine, *_ = _engine(config)
    for i in range(3):
        x, y = _batch(i)
        engine.backward(engine(x.half(), y.half()))
        engine.step()
    engine.save_checkpoint(save_dir, client_state={"epoch": 7})
    twin = copy.deepcopy(engine.module.state_dict())
    scale_at_save = engine.loss_scale
    expected_next = _one_more_step(engine)

    resumed, *_ = _engine(config)
    path, client = resumed.load_checkpoint(save_dir)
    assert path.endswith(os.path.join("global_step3", "mp_rank_00_model_states.pt"))
    assert client == {"epoch": 7}
    assert resumed.global_steps == 3 and resumed.loss_scale == scale_at_save
    for k, v in resumed.module.state_dict().items():
        assert torch.equal(v, twin[k]), k
    got_next = _one_more_step(resumed)
    for a, b in zip(expected_next, got_next, strict=True):
        assert torch.equal(a, b)
    engine.destroy()
    resumed.destroy()


def _one_more_step(engine) -> list[torch.Tensor]:
    x, y = _batch(99)
    engine.backward(engine(x.half(), y.half()))
    engine.step()
    return [p.detach().clone() for p in engine.module.parameters()]


def save_16bit_model(save_dir: str) -> None:
    engine, *_ = _engine({**adamw_config(2, 1, 0.0), "bf16": {"enabled": True}})
    assert engine.save_16bit_model(save_dir, "weights.bin")
    state = torch.load(os.path.join(save_dir, "weights.bin"))
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    assert set(state) == set(engine.module.state_dict())
    engine.destroy()


def test_accumulation_boundary_and_counters(dist_pool):
    dist_pool(2).run(boundary_and_counters)


def test_no_sync_equals_accumulation(dist_pool):
    dist_pool(2).run(no_sync_matches_plain_accumulation)


def test_client_optimizer_and_scheduler_win(dist_pool):
    dist_pool(2).run(client_optimizer_and_scheduler_override_config)


def test_config_scheduler_steps_per_optimizer_step(dist_pool):
    dist_pool(2).run(config_scheduler_steps_with_the_optimizer)


def test_dataloader_gives_each_rank_a_disjoint_shard(dist_pool):
    shards = dist_pool(2).run(dataloader_shards_the_dataset)
    assert sorted(shards[0] + shards[1]) == list(range(20))


def test_checkpoint_resume_continues_identically(dist_pool):
    with tempfile.TemporaryDirectory() as tmp:
        dist_pool(2).run(checkpoint_round_trip, tmp)
        assert open(os.path.join(tmp, "latest")).read() == "global_step3"


def test_save_16bit_model(dist_pool):
    with tempfile.TemporaryDirectory() as tmp:
        dist_pool(2).run(save_16bit_model, tmp)


def test_initialize_rejects_a_model_passed_as_args():
    with pytest.raises(TypeError, match="model=model"):
        shardspeed.initialize(MLP())


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_size_must_divide_the_world(size: int) -> None:
    """``tensor_parallel.autotp_size`` > 1 is never silently trained as data parallelism: on
    one rank it cannot split anything, and says so."""
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": size}}
    with pytest.raises(ValueError, match=f"autotp_size={size} does not divide the world size 1"):
        shardspeed.initialize(model=MLP(), config=config)


def test_tensor_parallel_size_one_trains() -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 1}}
    engine, *_ = shardspeed.initialize(model=MLP(), config=config)
    assert engine.dp_world_size == 1


def test_on_device_meta_allocates_nothing():
    with shardspeed.OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(1024, 1024)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32
    with shardspeed.OnDevice(dtype=None, device="cpu"):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"
