"""Checkpoints resume on another data-parallel size, bucket size or ZeRO stage (0-2), directly
or through the universal form; tags are validated across ranks.

A job saves mid-training, records its full optimizer state and goes on; a job of another shape
loads the save and must hold the same full state (bit for bit: resharding only moves numbers)
and continue with the same losses and parameters as the saving job (the global batch is kept the
same: micro 2 x gas x world = 8 rows, so only float summation order differs).
"""

from __future__ import annotations

import copy
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardspeed.checkpoint import crash_points
from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from shardspeed.checkpoint.ds_to_universal import convert
from shardspeed.checkpoint.reshard import Resharder
from shardspeed.utils import logger, safe_get_full_fp32_param, safe_get_full_optimizer_state
from shardspeed.zero import GatheredParameters
from tests.checkpoint.plan_spy import captured_plans, check_plan
from tests.runtime.parity import assert_close, make_task, param_setup, rank_rows
from tests.runtime.zero.ranks import SHARD_ALL, _engine, _precision

GLOBAL_ROWS = 8
KEYS = ("exp_avg", "exp_avg_sq")


def _full_state(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 value and Adam state, gathered from all ranks."""
    state = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            state[name] = safe_get_full_fp32_param(param).clone()
            for key in KEYS:
                state[f"{name}:{key}"] = safe_get_full_optimizer_state(param, key).clone()
    return state


def _train(engine: Any, task: Any, steps: range, gas: int) -> list[float]:
    """Train ``steps``; each step's loss averaged over the whole global batch (all ranks)."""
    x, y = task.data
    losses = []
    for step in steps:
        total = torch.zeros(())
        for micro_step in range(gas):
            rows = rank_rows(step, micro_step, 2, gas)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (gas * dist.get_world_size()))
    return losses


def _build(
    stage: int,
    bucket: int,
    seed: int,
    dtype: str = "fp32",
    groups: bool = False,
    mics: int = -1,
    **extra: Any,
) -> tuple[Any, Any, int]:
    """An engine on a tiny GPT; ``groups``: two parameter groups and a frozen embedding;
    ``mics``: MiCS shard groups of that many ranks (stage 3)."""
    gas = GLOBAL_ROWS // (2 * dist.get_world_size())
    torch.manual_seed(0)
    task = make_task("gpt", rows=6 * GLOBAL_ROWS)
    torch.manual_seed(seed)  # the loading job's own initial weights must not matter
    zero = {"reduce_bucket_size": bucket, **SHARD_ALL, "mics_shard_size": mics}
    config = {**_precision(dtype), **extra}
    model = task.build()
    params = param_setup(model, groups=True, freeze=True) if groups else None
    engine = _engine(model, stage, gas=gas, zero=zero, model_parameters=params, **config)
    return engine, task, gas


def save_and_continue(
    folder: str, stage: int, bucket: int, dtype: str = "fp32", groups: bool = False, mics: int = -1
) -> None:
    engine, task, gas = _build(stage, bucket, seed=0, dtype=dtype, groups=groups, mics=mics)
    _train(engine, task, range(3), gas)
    engine.save_checkpoint(folder, tag="mid")
    saved = _full_state(engine)
    losses = _train(engine, task, range(3, 6), gas)
    with GatheredParameters(list(engine.module.parameters())):  # stage 3 holds shards
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if dist.get_rank() == 0:
        torch.save({"state": saved, "losses": losses, "params": params}, Path(folder) / "ref.pt")
    dist.barrier()
    engine.destroy()


def load_and_continue(
    folder: str,
    stage: int,
    bucket: int,
    dtype: str = "fp32",
    groups: bool = False,
    universal: bool = False,
    mics: int = -1,
    legacy: bool = False,
) -> None:
    """Load the save of :func:`save_and_continue` at another shape and go on in parity; the
    load ran through the one reader, which checked the save's record (``legacy``: a checkpoint
    written before the record; a universal folder has none either)."""
    extra: dict[str, Any] = {"checkpoint": {"load_universal": True}} if universal else {}
    engine, task, gas = _build(
        stage, bucket, seed=123, dtype=dtype, groups=groups, mics=mics, **extra
    )
    with captured_plans() as plans:
        # universal: the tag comes from latest_universal
        path, _ = engine.load_checkpoint(folder, tag=None if universal else "mid")
    assert path is not None and engine.global_steps == 3
    check_plan(plans[0], recorded=not (legacy or universal))
    ref = torch.load(Path(folder) / "ref.pt", weights_only=False)
    loaded = _full_state(engine)
    assert loaded.keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        assert torch.equal(loaded[key], value), key
    if dtype != "fp32":  # bf16 training diverges with the summation order: state only
        engine.destroy()
        return
    losses = _train(engine, task, range(3, 6), gas)
    assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), "losses", 1e-5, 1e-6)
    with GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            assert_close(param.detach(), ref["params"][name], name, 1e-5, 1e-6)
    engine.destroy()


# (ranks, stage, bucket) saving -> (ranks, stage, bucket) loading, and the precision
RESHAPES = {
    # more ranks, stage 1 -> 2, other bucket boundaries
    "w2-s1-to-w4-s2": ((2, 1, 3000), (4, 2, 7000), "fp32"),
    # fewer ranks, stage 2 -> 1, one bucket per parameter group
    "w4-s2-to-w2-s1": ((4, 2, 5000), (2, 1, 500_000_000), "fp32"),
    "w2-same-ranks-other-buckets": ((2, 2, 500_000_000), (2, 2, 2000), "fp32"),
    # stage 0's whole state into partitions, and back
    "w2-s0-to-w4-s2": ((2, 0, 3000), (4, 2, 5000), "fp32"),
    "w4-s1-to-w2-s0": ((4, 1, 3000), (2, 0, 3000), "fp32"),
    # separate fp32 masters: bf16 stage 0 <-> stage 2 (state only, see load_and_continue)
    "bf16-w2-s0-to-w2-s2": ((2, 0, 3000), (2, 2, 5000), "bf16"),
    "bf16-w2-s2-to-w2-s0": ((2, 2, 5000), (2, 0, 3000), "bf16"),
    # two parameter groups (own lr and weight decay) and a frozen, tied embedding
    "groups-w2-s2-to-w4-s1": ((2, 2, 3000), (4, 1, 6000), "fp32-groups"),
    "groups-w4-s1-to-w2-s0": ((4, 1, 3000), (2, 0, 3000), "fp32-groups"),
    # stage 3 (its buckets are its gather units, whatever the bucket size), both ways
    "w2-s3-to-w4-s1": ((2, 3, 3000), (4, 1, 5000), "fp32"),
    "w4-s2-to-w2-s3": ((4, 2, 3000), (2, 3, 3000), "fp32"),
    "w2-s3-to-w1-s0": ((2, 3, 3000), (1, 0, 3000), "fp32"),
    "w1-s0-to-w2-s3": ((1, 0, 3000), (2, 3, 3000), "fp32"),
    "w2-s3-to-w4-s3": ((2, 3, 3000), (4, 3, 3000), "fp32"),
    "bf16-w2-s3-to-w2-s0": ((2, 3, 3000), (2, 0, 3000), "bf16"),
    "groups-w2-s3-to-w4-s2": ((2, 3, 3000), (4, 2, 6000), "fp32-groups"),
}


@pytest.mark.parametrize("case", list(RESHAPES))
@pytest.mark.timeout(240)
def test_resume_in_another_shape(dist_pool, tmp_path, case):
    (world_a, *saved), (world_b, *loaded), kind = RESHAPES[case]
    dtype, groups = kind.removesuffix("-groups"), kind.endswith("-groups")
    dist_pool(world_a).run(save_and_continue, str(tmp_path), *saved, dtype, groups)
    dist_pool(world_b).run(load_and_continue, str(tmp_path), *loaded, dtype, groups)


def refusals(folder: str) -> None:
    """A missing shard is named (by the manifest check, on every rank; in a tag without a
    manifest, on the rank that needs it) and stops every rank (none is left waiting in a
    collective); a failed save stops every rank and leaves ``latest`` alone."""
    base, rank = Path(folder), dist.get_rank()
    stage1, _, _ = _build(1, 3000, seed=1)
    stage1.save_checkpoint(str(base / "s1"), tag="t")
    dist.barrier()
    if rank == 0:
        (base / "s1" / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    dist.barrier()
    with pytest.raises(FileNotFoundError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        stage1.load_checkpoint(str(base / "s1"), tag="t")
    dist.barrier()
    if rank == 0:  # a legacy tag: no manifest
        (base / "s1" / "t" / "manifest.json").unlink()
    dist.barrier()
    expected = (
        (FileNotFoundError, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        if rank == 1
        else (RuntimeError, "another rank failed to load the optimizer state")
    )
    with pytest.raises(expected[0], match=expected[1]):
        stage1.load_checkpoint(str(base / "s1"), tag="t")
    stage1.load_checkpoint(str(base / "s1"), tag="t", load_optimizer_states=False)
    # rank 1 fails to write its shard (an injected write error, tests/checkpoint/crash_points)
    if rank == 1:
        os.environ[crash_points.FAIL_AT] = "1"
        crash_points.reset()
    try:
        failed = "injected checkpoint write failure" if rank == 1 else "another rank failed"
        with pytest.raises(RuntimeError, match=failed):
            stage1.save_checkpoint(str(base / "s1"), tag="u")
    finally:
        os.environ.pop(crash_points.FAIL_AT, None)
    dist.barrier()  # rank 0 removes what the failed save staged
    assert (base / "s1" / "latest").read_text() == "t"
    assert not (base / "s1" / "u").exists() and not (base / "s1" / ".u.saving").exists()
    stage1.destroy()


def node_local_and_legacy_format(folder: str) -> None:
    """use_node_local_storage: each node's first rank writes the model states to its own disk,
    and a rank resuming in the same layout reads only its own shard from there.
    checkpoint_serialization false: torch's legacy format, loaded without a memory map."""
    base, rank = Path(folder), dist.get_rank()
    saved_local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # two one-rank "nodes", each with its own disk below
    try:
        for options in ({"use_node_local_storage": True}, {"checkpoint_serialization": False}):
            node_local = "use_node_local_storage" in options
            disk = base / (f"node{rank}" if node_local else "shared")
            engine, task, gas = _build(2, 3000, seed=0, checkpoint=options)
            _train(engine, task, range(1), gas)
            engine.save_checkpoint(str(disk), tag="t")
            state = _full_state(engine)
            engine.destroy()
            files = sorted(p.name for p in (disk / "t").iterdir())
            if node_local:  # this node's disk: the model states and this rank's shard only
                assert files == [
                    "manifest.json",  # listing the files on this disk
                    "mp_rank_00_model_states.pt",
                    f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                ], files
            else:
                assert not any(zipfile.is_zipfile(disk / "t" / name) for name in files)
            loaded, _, _ = _build(2, 3000, seed=1, checkpoint=options)
            loaded.load_checkpoint(str(disk))
            for key, value in _full_state(loaded).items():
                assert torch.equal(value, state[key]), key
            loaded.destroy()
    finally:
        if saved_local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved_local_rank


def test_node_local_storage_and_legacy_format(dist_pool, tmp_path):
    dist_pool(2).run(node_local_and_legacy_format, str(tmp_path))
    # the legacy-format checkpoint consolidates too
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "shared")
    assert state["wte.weight"].dtype == torch.float32


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("saved_stage", "loads"),
    [(2, [(4, 1, 5000), (2, 0, 3000)]), (3, [(4, 3, 3000)])],
    ids=["stage2-to-1-and-0", "stage3-to-3"],
)
def test_universal_checkpoint_round_trip(dist_pool, tmp_path, saved_stage, loads):
    """ds_to_universal writes each parameter whole; load_universal resumes from it elsewhere."""
    dist_pool(2).run(save_and_continue, str(tmp_path), saved_stage, 3000)
    out = convert(tmp_path / "mid", tmp_path / "mid_universal")
    assert (tmp_path / "latest_universal").read_text() == "mid_universal"
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)["state"]
    for name in ("wte.weight", "blocks.0.attn.qkv.bias"):
        fp32 = torch.load(out / "zero" / name / "fp32.pt")["param"]
        exp_avg = torch.load(out / "zero" / name / "exp_avg.pt")["param"]
        assert torch.equal(fp32, ref[name]) and torch.equal(exp_avg, ref[f"{name}:exp_avg"])
    assert float(torch.load(out / "zero" / "wte.weight" / "step.pt")["param"]) == 3
    for world, stage, bucket in loads:
        dist_pool(world).run(load_and_continue, str(tmp_path), stage, bucket, "fp32", False, True)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def tag_checks(folder: str) -> None:
    rank = dist.get_rank()
    warnings = _Collect()
    logger.addHandler(warnings)
    for mode in ("Warn", "Fail", "Ignore"):
        warnings.messages.clear()
        engine, _, _ = _build(1, 3000, seed=0, checkpoint={"tag_validation": mode})
        if mode == "Fail":
            with pytest.raises(ValueError, match="differs between ranks"):
                engine.save_checkpoint(folder, tag=f"fail{rank}")
        else:
            engine.save_checkpoint(folder, tag=f"{mode}{rank}")
            warned = any("differs between ranks" in m for m in warnings.messages)
            assert warned == (mode == "Warn"), (mode, warnings.messages)
        engine.save_checkpoint(folder, tag=f"same-{mode}")  # the same tag passes every mode
        engine.destroy()
    engine, _, _ = _build(1, 3000, seed=0, checkpoint={"load_universal": True})
    with pytest.raises(ValueError, match="latest_universal"):
        engine.load_checkpoint(folder)
    engine.destroy()
    logger.removeHandler(warnings)


def test_tag_validation_and_missing_latest_universal(dist_pool, tmp_path):
    dist_pool(2).run(tag_checks, str(tmp_path))
    assert not (tmp_path / "fail0").exists() and (tmp_path / "same-Fail").is_dir()


def optimizer_state_round_trip(stage: int) -> None:
    """The optimizer's own state_dict loads back into it (fp32: masters saved as None)."""
    engine, task, gas = _build(stage, 3000, seed=0)
    _train(engine, task, range(1), gas)
    before = _full_state(engine)
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    after = _full_state(engine)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
def test_optimizer_state_dict_round_trip(dist_pool, stage):
    dist_pool(2).run(optimizer_state_round_trip, stage)


def test_refusals(dist_pool, tmp_path):
    dist_pool(2).run(refusals, str(tmp_path))


def _wrapper_state(
    layout: list[dict[str, Any]], world: int, rank: int, full: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """A rank's saved optimizer-wrapper state, cut by hand from per-parameter ``full`` tensors."""
    masters, states = [], {}
    for bucket in layout:
        chunk = bucket["size"] // world
        flat = {kind: torch.zeros(bucket["size"]) for kind in ("master", "m")}
        for name, offset, numel in bucket["params"]:
            flat["master"][offset : offset + numel] = full[name]
            flat["m"][offset : offset + numel] = -full[name]
        part = slice(chunk * rank, chunk * (rank + 1))
        masters.append(flat["master"][part].clone())
        states[bucket["state_index"]] = {"step": torch.tensor(7.0), "m": flat["m"][part].clone()}
    groups = [{"lr": 0.1, "params": [b["state_index"] for b in layout]}]
    return {
        "optimizer": {"state": states, "param_groups": groups},
        "loss_scaler": {"cur_scale": 1.0},
        "strategy": {"stage": 1, "dp_world_size": world, "layout": layout, "fp32_chunks": masters},
    }


def test_resharder_index_arithmetic():
    """3 ranks, two buckets -> 2 ranks, one bucket in another parameter order; no processes."""
    full = {
        "a": torch.arange(1.0, 6.0),
        "b": torch.arange(10.0, 14.0),
        "c": torch.arange(20.0, 27.0),
    }
    old = [
        {"group": 0, "size": 9, "state_index": 0, "params": [["a", 0, 5], ["b", 5, 4]]},
        {"group": 0, "size": 9, "state_index": 1, "params": [["c", 0, 7]]},
    ]
    new = [
        {
            "group": 0,
            "size": 18,
            "state_index": 0,
            "params": [["c", 0, 7], ["b", 7, 4], ["a", 11, 5]],
        }
    ]
    shards = [_wrapper_state(old, 3, r, full) for r in range(3)]
    resharder = Resharder(lambda r: copy.deepcopy(shards[r]), 3, module_state={})
    got = [resharder.state_for(new, 2, r) for r in range(2)]
    expected = _wrapper_state(new, 2, 0, full), _wrapper_state(new, 2, 1, full)
    for mine, want in zip(got, expected, strict=True):
        assert torch.equal(mine["strategy"]["fp32_chunks"][0], want["strategy"]["fp32_chunks"][0])
        assert torch.equal(mine["optimizer"]["state"][0]["m"], want["optimizer"]["state"][0]["m"])
        assert mine["optimizer"]["state"][0]["step"] == 7.0
        assert mine["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
        assert mine["strategy"]["chunk_numel"] == [9]
    # a model with another parameter set is refused by name
    with pytest.raises(ValueError, match=r"missing from the checkpoint \['d'\]"):
        resharder.state_for(
            [{"group": 0, "size": 2, "state_index": 0, "params": [["d", 0, 2]]}], 2, 0
        )


def masters_from_16bit_weights(folder: str) -> None:
    """zero_optimization.load_from_fp32_weights=false starts the masters from the bf16 module
    weights; the default takes the saved fp32 masters."""
    saving, task, gas = _build(2, 3000, seed=0, dtype="bf16")
    _train(saving, task, range(2), gas)
    saving.save_checkpoint(folder, tag="t")
    saved = _full_state(saving)
    saving.destroy()
    for from_fp32 in (True, False):
        torch.manual_seed(1)
        zero = {"reduce_bucket_size": 3000, "load_from_fp32_weights": from_fp32}
        engine = _engine(task.build(), 2, gas=gas, zero=zero, **_precision("bf16"))
        engine.load_checkpoint(folder, tag="t")
        for name, param in engine.module.named_parameters():
            master = safe_get_full_fp32_param(param)
            expected = saved[name] if from_fp32 else param.detach().float()
            assert torch.equal(master, expected), (from_fp32, name)
            # the optimizer state loads either way
            assert torch.equal(
                safe_get_full_optimizer_state(param, "exp_avg"), saved[f"{name}:exp_avg"]
            )
        assert not torch.equal(saved["wte.weight"], engine.module.wte.weight.float())
        engine.destroy()


def test_load_from_fp32_weights(dist_pool, tmp_path):
    dist_pool(2).run(masters_from_16bit_weights, str(tmp_path))


def checkpoint_config_refusals() -> None:
    for section, match in (
        ({"nebula": {"enabled": True}}, "nebula.enabled=true"),
        ({"checkpoint": {"writer": {"type": "mock"}}}, 'writer.type="MOCK"'),
    ):
        with pytest.raises(NotImplementedError, match=match):
            _build(1, 3000, seed=0, **section)
    engine, _, _ = _build(1, 3000, seed=0, checkpoint={"writer": {"type": "fast"}})
    engine.destroy()  # FAST is accepted: the files are the same, written with torch.save


def test_checkpoint_config_refusals(dist_pool):
    dist_pool(2).run(checkpoint_config_refusals)
