"""A checkpoint written by DeepSpeed's ZeRO-3 loads into shardspeed, on any stage and world size,
and consolidates.

The fixtures (tests/fixtures/deepspeed_zero3 and deepspeed_zero3_bf16, made by DeepSpeed 0.16.0
itself: see deepspeed_zero3/make_fixture.py) hold a 2-rank ZeRO-3 checkpoint of the tiny GPT
after 3 AdamW steps (three optimizer sub-groups, empty module tensors, the weights in the
optimizer shards) and the full fp32 masters and Adam moments DeepSpeed reported;
deepspeed_zero3_odd holds a small MLP whose partitions end in padding and one of whose
parameters is frozen (its partitions in the model-states files). shardspeed must
load exactly those numbers without DeepSpeed installed, train on from them, and consolidate them
with zero_to_fp32 (the functions, the standalone script and the ``shardspeed-zero-to-fp32``
command).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardspeed.checkpoint.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)
from shardspeed.checkpoint.ds_to_universal import convert
from shardspeed.checkpoint.reader import load_file
from shardspeed.checkpoint.standalone import write_script
from shardspeed.utils import safe_get_full_fp32_param
from shardspeed.zero import GatheredParameters
from tests.checkpoint.test_reshard import _full_state
from tests.checkpoint.test_standalone import run_isolated
from tests.runtime.parity import Task, make_task, rank_rows
from tests.runtime.zero.ranks import _engine, _precision

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FP32, BF16, ODD = "deepspeed_zero3", "deepspeed_zero3_bf16", "deepspeed_zero3_odd"
RANK0_MODEL = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def odd_model() -> nn.Module:
    """The model of the ``deepspeed_zero3_odd`` fixture: parameters of odd sizes (each
    partition of 2 or 4 ranks ends in padding) and a frozen first bias (DeepSpeed keeps its
    partitions in the model-states files)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].bias.requires_grad_(False)
    return model


def odd_task() -> Task:
    """Rows of (input, target) for :func:`odd_model`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 7, generator=gen)
    return Task(odd_model, (x, torch.tanh(x[:, :3])))


def _expected(fixture: str) -> dict[str, torch.Tensor]:
    return torch.load(FIXTURES / fixture / "expected_state.pt", weights_only=True)


def _masters(fixture: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _expected(fixture).items() if ":" not in k}


def _fresh(fixture: str) -> tuple[nn.Module, Task, Callable[..., torch.Tensor]]:
    """A model for ``fixture`` with other weights than its checkpoint (everything must come from
    it), the task, and the loss of a batch."""
    if fixture == ODD:
        task, model = odd_task(), odd_model()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        return model, task, lambda engine, x, y: nn.functional.mse_loss(engine(x), y)
    torch.manual_seed(7)
    task = make_task("gpt", rows=8 * dist.get_world_size())
    return task.build(), task, lambda engine, x, y: engine(x, y)


def load_and_train(stage: int, fixture: str, load_optimizer_states: bool = True) -> None:
    """Load the fixture into a fresh engine at ``stage``: DeepSpeed's numbers bit for bit, then
    training steps."""
    dtype = "bf16" if fixture == BF16 else "fp32"
    model, task, loss_of = _fresh(fixture)
    trainable = [p for p in model.parameters() if p.requires_grad]
    zero = {"reduce_bucket_size": 5000}
    engine = _engine(model, stage, zero=zero, model_parameters=trainable, **_precision(dtype))
    path, client_state = engine.load_checkpoint(
        str(FIXTURES / fixture), load_optimizer_states=load_optimizer_states
    )
    assert path is not None and path.endswith(f"ds/{RANK0_MODEL}"), path
    assert engine.global_steps == 3 and client_state == {}
    expected = _expected(fixture)
    if fixture == ODD:  # the frozen bias, from DeepSpeed's fragments: as the model was built
        expected["0.bias"] = odd_model()[0].bias.detach()
    with GatheredParameters(list(engine.module.parameters())):  # stage 3 holds shards
        # DeepSpeed's module holds its masters rounded to the training dtype: so does this one
        for name, param in engine.module.named_parameters():
            want = expected[name].to(param.dtype)
            assert torch.equal(param.detach(), want), (stage, fixture, name)
        if fixture != ODD:
            assert engine.module.lm_head.weight is engine.module.wte.weight  # still tied
    wanted = {k for k in expected if k != "0.bias" or fixture != ODD}
    if load_optimizer_states:
        loaded = _full_state(engine)
    else:  # the masters follow the module's weights; no moments yet
        params = engine.module.named_parameters()
        loaded = {n: safe_get_full_fp32_param(p) for n, p in params if p.requires_grad}
        wanted = {k for k in wanted if ":" not in k}
    assert set(loaded) == wanted
    for key, value in loaded.items():
        assert torch.equal(value, expected[key]), (stage, fixture, key)
    x, y = task.data
    for step in range(2):
        rows = rank_rows(step, 0, 2, 1)
        loss = loss_of(engine, x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
    assert engine.global_steps == 5
    engine.destroy()


def load_cases(cases: list[tuple[int, str, bool]]) -> None:
    """Every case on one process group (starting one is the costly part)."""
    for stage, fixture, optimizer in cases:
        load_and_train(stage, fixture, optimizer)


#: (stage, fixture, load the optimizer state) per world size: the saving world size at stage 3,
#: and smaller and larger ones at other stages
CASES = {
    2: [(3, FP32, True), (3, BF16, True), (2, FP32, False), (3, ODD, True)],
    1: [(0, FP32, True), (3, BF16, True)],
    4: [(2, FP32, True), (0, BF16, True), (3, ODD, True), (1, ODD, False)],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", sorted(CASES), ids=lambda w: f"world{w}")
def test_deepspeed_zero3_checkpoint_loads(dist_pool, world):
    dist_pool(world).run(load_cases, CASES[world], timeout_s=200)


def _consolidated(fixture: str) -> dict[str, torch.Tensor]:
    """What zero_to_fp32 must give for ``fixture``: DeepSpeed's masters, tied names again, the
    frozen bias as built."""
    state = _masters(fixture)
    if fixture == ODD:
        state["0.bias"] = odd_model()[0].bias.detach()
    else:
        state["lm_head.weight"] = state["wte.weight"]  # tied, saved under both names
    return state


@pytest.mark.parametrize("fixture", [FP32, BF16, ODD])
def test_zero_to_fp32_consolidates_a_deepspeed_zero3_checkpoint(fixture):
    state = get_fp32_state_dict_from_zero_checkpoint(FIXTURES / fixture)
    expected = _consolidated(fixture)
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    lazy = get_fp32_state_dict_from_zero_checkpoint(FIXTURES / fixture, lazy_mode=True)
    assert lazy.keys() == state.keys()
    assert all(torch.equal(lazy[k].contiguous(), v) for k, v in state.items())
    trained = get_fp32_state_dict_from_zero_checkpoint(
        FIXTURES / fixture, exclude_frozen_parameters=True
    )
    assert trained.keys() == expected.keys() - {"0.bias"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fixture", [BF16, ODD])
def test_standalone_script_consolidates_a_deepspeed_zero3_checkpoint(tmp_path, fixture):
    """The torch-only zero_to_fp32.py, run where shardspeed cannot be imported."""
    script = write_script(tmp_path)
    (tmp_path / "cwd").mkdir()
    run = run_isolated(script, FIXTURES / fixture, tmp_path / "out", cwd=tmp_path / "cwd")
    assert run.returncode == 0, run.stderr
    written = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = _consolidated(fixture)
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(written[name], value), name


@pytest.mark.timeout(240)
def test_command_consolidates_a_deepspeed_zero3_checkpoint(tmp_path):
    """``shardspeed-zero-to-fp32`` (the installed console script; its module where the
    environment has no script directory on PATH), split into several files."""
    found = shutil.which("shardspeed-zero-to-fp32")
    command = [found] if found else [sys.executable, "-m", "shardspeed.utils.zero_to_fp32"]
    args = [str(FIXTURES / FP32), str(tmp_path), "--max_shard_size", "20KB"]
    run = subprocess.run(command + args, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    files = sorted(tmp_path.glob("pytorch_model-*.bin"))
    assert len(files) > 1 and (tmp_path / "pytorch_model.bin.index.json").is_file()
    written: dict[str, torch.Tensor] = {}
    for file in files:
        written.update(torch.load(file, weights_only=True))
    expected = _consolidated(FP32)
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(written[name], value), name


def test_deepspeed_zero3_checkpoint_converts_to_universal(tmp_path):
    out = convert(FIXTURES / BF16 / "ds", tmp_path / "ds_universal")
    expected = _expected(BF16)
    for name in ("wte.weight", "blocks.1.mlp.2.bias", "ln_f.bias"):
        for key, saved in (("fp32", name), ("exp_avg", f"{name}:exp_avg")):
            value = torch.load(out / "zero" / name / f"{key}.pt", weights_only=True)["param"]
            assert torch.equal(value, expected[saved]), (name, key)


def _copy(fixture: str, target: Path) -> Path:
    shutil.copytree(FIXTURES / fixture, target, ignore=shutil.ignore_patterns("*.py"))
    return target


def refused_by_the_engine(folder: str) -> None:
    engine = _engine(make_task("gpt", rows=8).build(), 3)
    with pytest.raises(ValueError, match=r"offload_optimizer\.device 'nvme'"):
        engine.load_checkpoint(folder)
    engine.destroy()


@pytest.mark.timeout(240)
def test_unreadable_deepspeed_zero3_forms_are_named(dist_pool, tmp_path):
    # NVMe offload: DeepSpeed saves what it swapped out as empty tensors
    nvme = _copy(FP32, tmp_path / "nvme")
    for rank in range(2):
        path = nvme / "ds" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        model = torch.load(path, weights_only=False)
        model["ds_config"]["zero_optimization"]["offload_optimizer"] = {"device": "nvme"}
        torch.save(model, path)
    with pytest.raises(ValueError, match=r"offload_optimizer\.device 'nvme'"):
        get_fp32_state_dict_from_zero_checkpoint(nvme)
    # the same, found from the files alone: a sub-group's partition left empty
    empty = _copy(FP32, tmp_path / "empty")
    path = empty / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard = load_file(path, mmap=False)  # plain data; not mapped: the file is rewritten
    shard["optimizer_state_dict"]["fp32_flat_groups"][1] = torch.empty(0)
    torch.save(shard, path)
    with pytest.raises(ValueError, match="sub-group 1's fp32 partition holds 0 elements"):
        get_fp32_state_dict_from_zero_checkpoint(empty)
    # a universal conversion without the shards: named, not a bare missing file
    universal = _copy(FP32, tmp_path / "universal")
    for shard_path in (universal / "ds").glob("*optim_states.pt"):
        shard_path.unlink()
    (universal / "ds" / "zero" / "wte.weight").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="DeepSpeed's universal form"):
        get_fp32_state_dict_from_zero_checkpoint(universal)
    # shards of another save (ZeRO 2's) beside ZeRO-3 model files
    mixed = _copy(FP32, tmp_path / "mixed")
    for shard_path in (FIXTURES / "deepspeed_zero2" / "ds").glob("*optim_states.pt"):
        shutil.copy(shard_path, mixed / "ds" / shard_path.name)
    with pytest.raises(ValueError, match="not a DeepSpeed ZeRO-3 optimizer shard"):
        get_fp32_state_dict_from_zero_checkpoint(mixed)
    with pytest.raises(ValueError, match="offload_optimizer"):
        convert_zero_checkpoint_to_fp32_state_dict(nvme, tmp_path / "out")
    # load_checkpoint says the same on every rank (ZeRO-3's weights are in the shards, so even
    # load_optimizer_states=False needs them)
    dist_pool(1).run(refused_by_the_engine, str(nvme), timeout_s=200)
