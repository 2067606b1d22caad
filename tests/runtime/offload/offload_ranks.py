"""Rank functions of the ZeRO-Offload tests (run on live gloo ranks)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from shardspeed.ops.adam import DeepSpeedCPUAdam
from tests.runtime.parity import MLP, adamw_config, make_task, rank_rows
from tests.runtime.zero.ranks import _engine


def offload_section(device: str, folder: str | None = None, ratio: float = 1.0) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "ratio": ratio}
    if folder is not None:
        section["nvme_path"] = folder
    return section


def optimizer_kind(stage: int, device: str, folder: str | None) -> str:
    """The class of the basic optimizer the config's AdamW becomes under offload."""
    zero = {"offload_optimizer": offload_section(device, folder)}
    engine = _engine(MLP(width=8), stage, zero=zero)
    kind = type(engine.optimizer.optimizer).__name__
    assert isinstance(engine.optimizer.optimizer, DeepSpeedCPUAdam)
    engine.destroy()
    return kind


def client_optimizer_check(force: bool) -> str:
    """A client torch optimizer under offload: refused unless zero_force_ds_cpu_optimizer is
    false."""
    model = MLP(width=8)
    config = adamw_config(
        2, 1, 0.0, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}
    )
    del config["optimizer"]
    config["zero_force_ds_cpu_optimizer"] = force
    try:
        engine, *_ = shardspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
        )
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    engine.destroy()
    return ""


def state_bytes_in_memory(engine: Any) -> int:
    return sum(
        value.untyped_storage().nbytes()
        for state in engine.optimizer.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.numel() > 1
    )


def shard_bytes_in_memory(engine: Any) -> int:
    """Bytes of stage 3's parameter shards (non-persistent units) held in memory."""
    return sum(
        flat.shard.untyped_storage().nbytes()
        for unit in engine.strategy.sharding.units
        if not unit.persistent
        for flat in unit.flats
    )


def nvme_trains_like_no_offload(
    stage: int,
    folder: str,
    ratio: float = 1.0,
    sub_group: int = 0,
    gas: int = 2,
    params: bool = False,
    optimizer: bool = True,
) -> dict[str, float]:
    """The same model trained with and without NVMe offload (of the optimizer state, and with
    ``params`` of stage 3's parameter shards): equal losses and parameters every step; between
    steps what is offloaded holds no memory and lives in files of the expected size."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=10 * 2 * gas * dist.get_world_size())
    base = task.build()
    zero: dict[str, Any] = {"stage3_param_persistence_threshold": 0}
    if sub_group:
        zero["sub_group_size"] = sub_group
    plain = _engine(copy.deepcopy(base), stage, gas=gas, zero=zero)
    offload: dict[str, Any] = {}
    if optimizer:
        offload["offload_optimizer"] = offload_section("nvme", folder, ratio)
    if params:
        offload["offload_param"] = {"device": "nvme", "nvme_path": folder}
    offloaded = _engine(copy.deepcopy(base), stage, gas=gas, zero={**zero, **offload})
    x, y = task.data
    state_total = 0
    for step in range(10):
        for micro_step in range(gas):
            rows = rank_rows(step, micro_step, 2, gas)
            losses = []
            for engine in (plain, offloaded):
                loss = engine(x[rows], y[rows])
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7)
        state_total = state_bytes_in_memory(plain)
    both = [*plain.module.parameters(), *offloaded.module.parameters()]
    with shardspeed.zero.GatheredParameters(both):
        for p, q in zip(plain.module.parameters(), offloaded.module.parameters(), strict=True):
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7)
    files = sorted(Path(folder).glob(f"swap_rank{dist.get_rank()}/*"))
    on_disk = sum(f.stat().st_size for f in files)
    result = {
        "shards_in_memory": float(shard_bytes_in_memory(offloaded) if params else -1),
        "shards_reference": float(shard_bytes_in_memory(plain) if params else -1),
        "state_in_memory": float(state_bytes_in_memory(offloaded)),
        "state_reference": float(state_total),
        "files": float(len(files)),
        "bytes_on_disk": float(on_disk),
    }
    for engine in (plain, offloaded):
        engine.destroy()
    return result


def checkpoints_cross_offload(stage: int, folder: str) -> list[float]:
    """Save with NVMe offload and load without, and the reverse: training continues with
    equal losses on all four engines."""
    torch.manual_seed(0)
    task = make_task("gpt", rows=6 * 2 * dist.get_world_size())
    base = task.build()
    root = Path(folder)

    def build(nvme: str | None) -> Any:
        zero: dict[str, Any] = {"stage3_param_persistence_threshold": 0}
        if nvme is not None:
            Path(nvme).mkdir(exist_ok=True)
            zero["offload_optimizer"] = offload_section("nvme", nvme)
        return _engine(copy.deepcopy(base), stage, zero=zero)

    def train(engine: Any, steps: range) -> list[float]:
        x, y = task.data
        out = []
        for step in steps:
            rows = rank_rows(step, 0, 2, 1)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    swapped, plain = build(str(root / "a")), build(None)
    assert train(swapped, range(3)) == train(plain, range(3))
    swapped.save_checkpoint(str(root / "ckpt_nvme"), tag="t")
    plain.save_checkpoint(str(root / "ckpt_plain"), tag="t")
    into_plain, into_swapped = build(None), build(str(root / "b"))
    into_plain.load_checkpoint(str(root / "ckpt_nvme"), tag="t")
    into_swapped.load_checkpoint(str(root / "ckpt_plain"), tag="t")
    curves = [train(e, range(3, 6)) for e in (swapped, plain, into_plain, into_swapped)]
    assert state_bytes_in_memory(into_swapped) == 0
    for curve in curves[1:]:
        assert curve == curves[0], curves
    for engine in (swapped, plain, into_plain, into_swapped):
        engine.destroy()
    return curves[0]


def full_disk_message(stage: int, folder: str, params: bool) -> str:
    """Build an engine whose swap files cannot fit under ``folder``: the error, at initialize
    (before any state is written)."""
    zero: dict[str, Any] = {"offload_optimizer": offload_section("nvme", folder)}
    if params:
        zero["offload_param"] = {"device": "nvme", "nvme_path": folder}
        zero["stage3_param_persistence_threshold"] = 0
    try:
        engine = _engine(MLP(width=512, depth=4), stage, zero=zero)
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    engine.destroy()
    return ""


def init_built_model_offloaded(folder: str) -> None:
    """A GPT built under zero.Init with small (persistent) and large units, parameters and
    optimizer state on NVMe: trains like the same model built and trained without offload."""
    from examples.gpt_model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=1024, block_size=8, n_layer=2, n_head=4, n_embd=128)
    zero: dict[str, Any] = {"stage3_param_persistence_threshold": 10_000}
    offload = {
        "offload_param": {"device": "nvme", "nvme_path": folder},
        "offload_optimizer": offload_section("nvme", folder),
    }
    config = adamw_config(2, 1, 1.0, zero_optimization={"stage": 3, **zero, **offload})
    torch.manual_seed(0)
    with shardspeed.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    swapped, *_ = shardspeed.initialize(model=model, config=config)
    torch.manual_seed(0)
    plain = _engine(GPT(cfg), 3, zero=zero)
    tokens = torch.randint(
        256, (4 * dist.get_world_size(), 9), generator=torch.Generator().manual_seed(1)
    )
    for step in range(4):
        rows = rank_rows(step % 2, 0, 2, 1)
        losses = []
        for engine in (plain, swapped):
            loss = engine(tokens[rows, :-1], tokens[rows, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7)
    assert shard_bytes_in_memory(swapped) == 0
    for engine in (plain, swapped):
        engine.destroy()


def offload_states_round_trip(stage: int) -> dict[str, list[str]]:
    """offload_states / reload_states between steps: training goes on bit-identically to an
    engine that never offloaded; get_state_devices names where each kind of state is."""
    from shardspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from shardspeed.runtime.zero.offload_states import get_state_devices

    torch.manual_seed(0)
    task = make_task("gpt", rows=8 * 2 * dist.get_world_size())
    base = task.build()
    zero = {"stage3_param_persistence_threshold": 0}
    moving, still = (_engine(copy.deepcopy(base), stage, zero=zero) for _ in range(2))
    x, y = task.data
    kinds = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params]
    kinds += [OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer]
    if stage == 3:
        kinds.append(OffloadStateTypeEnum.lp_params)
    devices: dict[str, list[str]] = {}
    for step in range(4):
        rows = rank_rows(step, 0, 2, 1)
        losses = []
        for engine in (moving, still):
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[0] == losses[1], losses
        moving.offload_states(include=kinds, device=OffloadDeviceEnum.cpu, pin_memory=True)
        for kind in kinds:
            devices[kind.value] = sorted(str(d) for d in get_state_devices(moving, kind))
        moving.reload_states()
    refusals = []
    try:
        moving.offload_states(device="nvme")
    except ValueError as error:
        refusals.append(str(error))
    if stage < 3:
        try:
            moving.offload_states(include=[OffloadStateTypeEnum.lp_params])
        except NotImplementedError as error:
            refusals.append(str(error))
    devices["refusals"] = refusals
    for engine in (moving, still):
        engine.destroy()
    return devices
