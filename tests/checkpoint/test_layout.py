"""The saved layout's version: a checkpoint without one (written before versioning) and one of
this version load; one of a newer version is refused by every reader, naming the file, the
version and the fix."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from shardspeed.checkpoint.files import MODEL_STATES, shard_paths
from shardspeed.checkpoint.layout import LAYOUT_VERSION, check_layout_version, versioned
from shardspeed.checkpoint.reader import load_file
from shardspeed.checkpoint.reshard import Resharder
from shardspeed.checkpoint.sources import saved_shards
from shardspeed.checkpoint.standalone import write_script
from tests.checkpoint.test_reshard import _build
from tests.checkpoint.test_standalone import run_isolated

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "shardspeed_7925258"
NEWER = LAYOUT_VERSION + 1


def _stamped(tmp_path: Path, case: str, version: int) -> tuple[Path, list[Path]]:
    """A copy of an unversioned checkpoint of 7925258 whose strategy states all carry
    ``version``; returns it and the files changed."""
    root = tmp_path / case
    shutil.copytree(OLD / case, root)
    folder = root / "mid"
    model = torch.load(folder / MODEL_STATES, weights_only=False)
    if model["optimizer"] is not None:  # stage 0: the strategy state is in the model file
        model["optimizer"]["strategy"]["layout_version"] = version
        torch.save(model, folder / MODEL_STATES)
        return root, [folder / MODEL_STATES]
    paths = shard_paths(folder, model["dp_world_size"])
    for path in paths:
        shard = torch.load(path, weights_only=False)
        shard["optimizer_state_dict"]["strategy"]["layout_version"] = version
        torch.save(shard, path)
    return root, paths


def test_version_of_a_strategy_state():
    assert check_layout_version({"stage": 2}, "f") == 0  # written before versioning
    state = {"stage": 2}
    assert versioned(state) is state and state == {"stage": 2, "layout_version": LAYOUT_VERSION}
    assert check_layout_version(state, "f") == LAYOUT_VERSION
    with pytest.raises(ValueError, match=rf"f holds a checkpoint of layout version {NEWER}, "):
        check_layout_version({"layout_version": NEWER}, "f")


@pytest.mark.parametrize("case", ["stage2_fp32_groups", "stage0_bf16"])
def test_this_version_reads_as_before(tmp_path, case):
    root, _ = _stamped(tmp_path, case, LAYOUT_VERSION)
    state = get_fp32_state_dict_from_zero_checkpoint(root)
    expected = get_fp32_state_dict_from_zero_checkpoint(OLD / case)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def _refusal(where: Path | str) -> str:
    return (
        f"{re.escape(str(where))} holds a checkpoint of layout version {NEWER}, written by a "
        rf"newer shardspeed; this one reads versions up to {LAYOUT_VERSION}\. Upgrade shardspeed"
    )


@pytest.mark.parametrize("case", ["stage2_fp32_groups", "stage0_bf16"])
def test_a_newer_version_is_refused_by_every_reader(tmp_path, case):
    root, files = _stamped(tmp_path, case, NEWER)
    folder = root / "mid"
    with pytest.raises(ValueError, match=_refusal(files[0])):
        get_fp32_state_dict_from_zero_checkpoint(root)
    model = load_file(folder / MODEL_STATES)
    with pytest.raises(ValueError, match=_refusal(files[-1])):
        shards = saved_shards(folder, model)  # stage 0: refused here
        assert shards is not None
        shards[0](shards[1] - 1)  # stages 1/2: on reading a shard
    if model["optimizer"] is None:  # stage 1/2 shards handed to the re-partitioner directly
        shard = load_file(files[0])["optimizer_state_dict"]
        with pytest.raises(ValueError, match=_refusal("the optimizer shard of rank 0")):
            Resharder(lambda _: shard, 2, model["module"])
    # the script beside the checkpoint too
    run = run_isolated(write_script(root), root, tmp_path / "out", cwd=tmp_path)
    assert run.returncode == 1 and re.search(_refusal(files[0]), run.stderr), run.stderr


def load_newer(folder: str) -> None:
    engine, _, _ = _build(2, 3000, seed=0, groups=True)
    with pytest.raises(ValueError, match="Upgrade shardspeed"):
        engine.load_checkpoint(folder, tag="mid")
    engine.destroy()


def test_load_checkpoint_refuses_a_newer_version(dist_pool, tmp_path):
    root, _ = _stamped(tmp_path, "stage2_fp32_groups", NEWER)
    dist_pool(2).run(load_newer, str(root))
