"""A checkpoint written by DeepSpeed's ZeRO 2 loads into shardspeed, on any stage and world size.

The fixture (tests/fixtures/deepspeed_zero2, made by DeepSpeed 0.16.0 itself: see its
make_fixture.py) holds a 2-rank ZeRO-2 checkpoint of the tiny GPT after 3 AdamW steps, and the
full fp32 masters and Adam moments DeepSpeed reported for it. shardspeed must load exactly those
numbers without DeepSpeed installed, and train on from them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from shardspeed.checkpoint.ds_to_universal import convert
from shardspeed.checkpoint.reader import load_file
from tests.checkpoint.test_reshard import _full_state
from tests.runtime.parity import make_task, rank_rows
from tests.runtime.zero.ranks import _engine, _precision

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FIXTURE = FIXTURES / "deepspeed_zero2"


def load_deepspeed_checkpoint(stage: int, fixture: str, dtype: str) -> None:
    folder = FIXTURES / fixture
    torch.manual_seed(7)  # other initial weights: everything must come from the checkpoint
    task = make_task("gpt", rows=8 * dist.get_world_size())
    engine = _engine(task.build(), stage, zero={"reduce_bucket_size": 5000}, **_precision(dtype))
    path, client_state = engine.load_checkpoint(str(folder))  # tag "ds" from 'latest'
    assert path is not None and path.endswith("ds/mp_rank_00_model_states.pt")
    assert engine.global_steps == 3 and client_state == {}
    expected = torch.load(folder / "expected_state.pt", weights_only=True)
    if dtype == "bf16":  # the module holds DeepSpeed's bf16 weights, the masters more
        weights = torch.load(folder / "ds" / "mp_rank_00_model_states.pt", weights_only=False)
        assert torch.equal(engine.module.wte.weight, weights["module"]["wte.weight"])
        assert not torch.equal(engine.module.wte.weight.float(), expected["wte.weight"])
    loaded = _full_state(engine)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    x, y = task.data
    loss = engine(x[rank_rows(0, 0, 2, 1)], y[rank_rows(0, 0, 2, 1)])
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss) and engine.global_steps == 4
    engine.destroy()


@pytest.mark.parametrize(
    "world,stage,fixture,dtype",
    [
        (2, 2, "deepspeed_zero2", "fp32"),
        (4, 1, "deepspeed_zero2", "fp32"),
        (2, 0, "deepspeed_zero2", "fp32"),
        (2, 2, "deepspeed_zero2_bf16", "bf16"),
        (4, 0, "deepspeed_zero2_bf16", "bf16"),
    ],
    ids=["w2-stage2", "w4-stage1", "w2-stage0", "bf16-w2-stage2", "bf16-w4-stage0"],
)
def test_deepspeed_zero2_checkpoint_loads(dist_pool, world, stage, fixture, dtype):
    dist_pool(world).run(load_deepspeed_checkpoint, stage, fixture, dtype)


def unreadable_forms(folder: str) -> None:
    """DeepSpeed checkpoints shardspeed cannot read yet are named as such, not as missing files."""
    base = Path(folder)
    engine = _engine(make_task("gpt", rows=8).build(), 1)
    with pytest.raises(ValueError, match="format shardspeed does not read yet"):
        engine.load_checkpoint(str(base / "bf16"), tag="ds")
    with pytest.raises(ValueError, match="DeepSpeed without ZeRO"):
        engine.load_checkpoint(str(base / "stage0"), tag="ds")
    engine.load_checkpoint(str(base / "stage0"), tag="ds", load_optimizer_states=False)
    engine.destroy()


def test_unreadable_deepspeed_forms_are_named(dist_pool, tmp_path):
    # DeepSpeed's bf16 optimizer (bf16 without ZeRO 2) keeps no single_partition_of_fp32_groups
    (tmp_path / "bf16" / "ds").mkdir(parents=True)
    for source in (FIXTURE / "ds").iterdir():
        target = tmp_path / "bf16" / "ds" / source.name
        if source.name.startswith("mp_rank"):
            target.write_bytes(source.read_bytes())
            continue
        saved = load_file(source)["optimizer_state_dict"]
        shard = {"base_optimizer_state": saved["base_optimizer_state"], "clip_grad": 1.0}
        torch.save({"optimizer_state_dict": shard}, target.with_name("bf16_" + source.name))
    # without ZeRO, DeepSpeed keeps a plain torch optimizer state in the model file
    (tmp_path / "stage0" / "ds").mkdir(parents=True)
    model = torch.load(FIXTURE / "ds" / "mp_rank_00_model_states.pt", weights_only=False)
    del model["param_shapes"]
    model["optimizer"] = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    torch.save(model, tmp_path / "stage0" / "ds" / "mp_rank_00_model_states.pt")
    dist_pool(2).run(unreadable_forms, str(tmp_path))


@pytest.mark.parametrize("fixture", ["deepspeed_zero2", "deepspeed_zero2_bf16"])
def test_zero_to_fp32_consolidates_a_deepspeed_checkpoint(fixture):
    """shardspeed's zero_to_fp32 (torch only) reads DeepSpeed's ZeRO 2 shards too."""
    state = get_fp32_state_dict_from_zero_checkpoint(FIXTURES / fixture)
    expected = torch.load(FIXTURES / fixture / "expected_state.pt", weights_only=True)
    masters = {k: v for k, v in expected.items() if ":" not in k}
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])  # tied, saved under both


def test_deepspeed_checkpoint_converts_to_universal(tmp_path):
    """ds_to_universal reads DeepSpeed's shards through the same sources as load_checkpoint."""
    out = convert(FIXTURE / "ds", tmp_path / "ds_universal")
    expected = torch.load(FIXTURE / "expected_state.pt", weights_only=True)
    for name in ("wte.weight", "blocks.1.mlp.2.bias"):
        for key, saved in (("fp32", name), ("exp_avg_sq", f"{name}:exp_avg_sq")):
            value = torch.load(out / "zero" / name / f"{key}.pt", weights_only=True)["param"]
            assert torch.equal(value, expected[saved]), (name, key)
