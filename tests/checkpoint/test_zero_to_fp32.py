"""``zero_to_fp32``: a ZeRO checkpoint consolidates into the fp32 masters the job trained.

Ranks train a tiny GPT (tied embeddings, a registered buffer, optionally a frozen layer), save,
and rank 0 records every parameter's full fp32 master through ``safe_get_full_fp32_param``. The
consolidated state_dict must equal that record bit for bit, in-process and through the script
``save_checkpoint`` writes next to the checkpoint (run with a plain ``python``, sharded output).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardspeed.checkpoint.consolidate import (
    _parse_size,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardspeed.utils import safe_get_full_fp32_param
from tests.runtime.parity import make_task
from tests.runtime.zero.ranks import _engine, _precision, _train


def train_and_save(folder: str, stage: int, dtype: str, freeze: bool) -> None:
    torch.manual_seed(0)
    task = make_task("gpt", rows=2 * 2 * dist.get_world_size())
    model = task.build()
    model.register_buffer("marker", torch.arange(3.0))
    if freeze:
        model.blocks[0].attn.requires_grad_(False)
    zero = {"reduce_bucket_size": 3000}
    engine = _engine(model, stage, gas=1, zero=zero, **_precision(dtype))
    _train(engine, task, range(2), 1)
    engine.save_checkpoint(folder)
    masters = {
        name: safe_get_full_fp32_param(p).clone()
        for name, p in engine.module.named_parameters()
        if p.requires_grad
    }
    if dist.get_rank() == 0:
        frozen = {
            n: p.detach().clone()
            for n, p in engine.module.named_parameters()
            if not p.requires_grad
        }
        torch.save({"masters": masters, "frozen": frozen}, Path(folder) / "ref.pt")
    dist.barrier()
    engine.destroy()


def _check(state: dict[str, Any], ref: dict[str, Any], frozen_included: bool) -> None:
    for name, master in ref["masters"].items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], master), name
    # the tied output head is its own name in the state_dict, with the embedding's master
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])
    assert torch.equal(state["marker"], torch.arange(3.0))
    for name, value in ref["frozen"].items():
        if frozen_included:
            assert torch.equal(state[name], value), name
        else:
            assert name not in state, name


@pytest.mark.parametrize(
    "stage,dtype,freeze",
    [(2, "bf16", False), (1, "fp32", True), (0, "bf16", True), (0, "fp32", True)],
    ids=["stage2-bf16", "stage1-fp32-frozen", "stage0-bf16-frozen", "stage0-fp32-frozen"],
)
@pytest.mark.timeout(240)
def test_consolidated_state_is_the_fp32_masters(dist_pool, tmp_path, stage, dtype, freeze):
    dist_pool(2).run(train_and_save, str(tmp_path), stage, dtype, freeze)
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    if dtype != "fp32":  # the masters carry more than the bf16 weights
        module = torch.load(
            tmp_path / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False
        )
        assert not torch.equal(module["module"]["wte.weight"].float(), ref["masters"]["wte.weight"])
    _check(get_fp32_state_dict_from_zero_checkpoint(tmp_path), ref, frozen_included=True)
    lean = get_fp32_state_dict_from_zero_checkpoint(
        tmp_path, "global_step2", exclude_frozen_parameters=True
    )
    _check(lean, ref, frozen_included=False)
    lazy = get_fp32_state_dict_from_zero_checkpoint(tmp_path, lazy_mode=True)
    _check({k: v.contiguous() for k, v in lazy.items()}, ref, frozen_included=True)


@pytest.mark.timeout(240)
def test_script_beside_the_checkpoint_writes_sharded_files(dist_pool, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    dist_pool(2).run(train_and_save, str(ckpt), 2, "fp32", False)
    script = ckpt / "zero_to_fp32.py"
    assert script.is_file()
    # a plain interpreter in another directory: the script needs torch, not shardspeed's tree
    run = subprocess.run(
        [sys.executable, str(script), str(ckpt), str(out), "--max_shard_size", "40KB"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    index = (out / "pytorch_model.bin.index.json").read_text()
    files = sorted(out.glob("pytorch_model-*.bin"))
    assert len(files) > 2 and all(f.name in index for f in files)
    state: dict[str, Any] = {}
    for f in files:
        state.update(torch.load(f, weights_only=True))
    _check(state, torch.load(ckpt / "ref.pt", weights_only=False), frozen_included=True)
    # one file under a large limit; the model loads it
    (single,) = convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "one")
    assert single.name == "pytorch_model.bin"
    model = make_task("gpt", rows=4).build()
    model.register_buffer("marker", torch.zeros(3))
    load_state_dict_from_zero_checkpoint(model, ckpt)
    assert torch.equal(model.marker, torch.arange(3.0))
    assert torch.equal(model.wte.weight, state["wte.weight"])


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a checkpoint tag"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="nope")
    assert _parse_size("5GB") == 5 * 10**9 and _parse_size("100KB") == 10**5 and _parse_size(7) == 7
    with pytest.raises(ValueError, match="max_shard_size"):
        _parse_size("lots")


def test_clone_tensors_for_torch_save_drops_the_flat_buffer(tmp_path):
    from collections import OrderedDict

    from shardspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(1000.0)
    state = OrderedDict(a=flat[:10], nested=[(flat[10:20], "tag")], n=3)
    lean = clone_tensors_for_torch_save(state)
    assert isinstance(lean, OrderedDict) and lean["n"] == 3 and lean["nested"][0][1] == "tag"
    assert torch.equal(lean["a"], flat[:10]) and torch.equal(lean["nested"][0][0], flat[10:20])
    torch.save(state, tmp_path / "fat.pt")
    torch.save(lean, tmp_path / "lean.pt")
    # the views drag the whole 4000-byte storage along; the clones hold 80 bytes each
    assert (tmp_path / "fat.pt").stat().st_size > (tmp_path / "lean.pt").stat().st_size + 3000


def test_deepspeed_path_reexports_the_package(tmp_path):
    """``shardspeed.utils.zero_to_fp32`` (DeepSpeed's path, a command and a console script)
    hands out the package's own functions."""
    from shardspeed.checkpoint import consolidate
    from shardspeed.utils import zero_to_fp32

    assert zero_to_fp32.__all__
    for name in zero_to_fp32.__all__:
        assert getattr(zero_to_fp32, name) is getattr(consolidate, name), name
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '\nshardspeed-zero-to-fp32 = "shardspeed.utils.zero_to_fp32:main"\n' in pyproject
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_zero2"
    run = subprocess.run(
        [sys.executable, "-m", "shardspeed.utils.zero_to_fp32", str(fixture), str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    written = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    expected = get_fp32_state_dict_from_zero_checkpoint(fixture)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())
