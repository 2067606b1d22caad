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

from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.runtime.parity import make_task, rank_rows
from tests.runtime.zero.ranks import _engine
from tests.runtime.zero.test_reshard import _full_state

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_zero2"


def load_deepspeed_checkpoint(stage: int) -> None:
    torch.manual_seed(7)  # other initial weights: everything must come from the checkpoint
    task = make_task("gpt", rows=8 * dist.get_world_size())
    engine = _engine(task.build(), stage, zero={"reduce_bucket_size": 5000})
    path, client_state = engine.load_checkpoint(str(FIXTURE))  # tag "ds" from 'latest'
    assert path is not None and path.endswith("ds/mp_rank_00_model_states.pt")
    assert engine.global_steps == 3 and client_state == {}
    expected = torch.load(FIXTURE / "expected_state.pt", weights_only=True)
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
    "world,stage", [(2, 2), (4, 1), (2, 0)], ids=["w2-stage2", "w4-stage1", "w2-stage0"]
)
def test_deepspeed_zero2_checkpoint_loads(dist_pool, world, stage):
    dist_pool(world).run(load_deepspeed_checkpoint, stage)


def unreadable_forms(folder: str) -> None:
    """DeepSpeed checkpoints shardspeed cannot read yet are named as such, not as missing files."""
    base = Path(folder)
    engine = _engine(make_task("gpt", rows=8).build(), 1)
    with pytest.raises(ValueError, match="bf16 optimizer"):
        engine.load_checkpoint(str(base / "bf16"), tag="ds")
    with pytest.raises(ValueError, match="DeepSpeed without ZeRO"):
        engine.load_checkpoint(str(base / "stage0"), tag="ds")
    engine.load_checkpoint(str(base / "stage0"), tag="ds", load_optimizer_states=False)
    engine.destroy()


def test_unreadable_deepspeed_forms_are_named(dist_pool, tmp_path):
    # DeepSpeed's bf16 optimizer names its shards bf16_zero_pp_rank_*
    (tmp_path / "bf16" / "ds").mkdir(parents=True)
    for source in (FIXTURE / "ds").iterdir():
        name = source.name if source.name.startswith("mp_rank") else f"bf16_{source.name}"
        (tmp_path / "bf16" / "ds" / name).write_bytes(source.read_bytes())
    # without ZeRO, DeepSpeed keeps a plain torch optimizer state in the model file
    (tmp_path / "stage0" / "ds").mkdir(parents=True)
    model = torch.load(FIXTURE / "ds" / "mp_rank_00_model_states.pt", weights_only=False)
    del model["param_shapes"]
    model["optimizer"] = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    torch.save(model, tmp_path / "stage0" / "ds" / "mp_rank_00_model_states.pt")
    dist_pool(2).run(unreadable_forms, str(tmp_path))


def test_zero_to_fp32_consolidates_a_deepspeed_checkpoint():
    """shardspeed's zero_to_fp32 (torch only) reads DeepSpeed's ZeRO 2 shards too."""
    state = get_fp32_state_dict_from_zero_checkpoint(FIXTURE)
    expected = torch.load(FIXTURE / "expected_state.pt", weights_only=True)
    masters = {k: v for k, v in expected.items() if ":" not in k}
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])  # tied, saved under both
