"""A tag is checked against its manifest before anything is loaded: a truncated or missing file
is named, never loaded as a partial checkpoint; with ``checkpoint.verify_checksums`` a changed
byte is found too. A tag without a manifest (legacy input) still loads, and a truncated file in
it is named when it is read. A re-save of a tag killed between moving the old folder aside and
renaming the new one into place leaves the old version loadable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from shardspeed.checkpoint.files import replaced_folder
from shardspeed.checkpoint.manifest import MANIFEST
from tests.checkpoint.test_safe_loading import ZERO, save_one
from tests.runtime.parity import make_task
from tests.runtime.zero.ranks import _engine

SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def _variants(source: Path, root: Path) -> None:
    """Copies of the checkpoint ``source``, each damaged in one way."""
    for name in ("truncated", "missing", "flipped", "legacy", "replaced"):
        shutil.copytree(source, root / name)
    shard = root / "truncated" / "t" / SHARD.format(1)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (root / "missing" / "t" / SHARD.format(0)).unlink()
    flipped = root / "flipped" / "t" / SHARD.format(1)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: the size stays the same
    flipped.write_bytes(bytes(data))
    legacy = root / "legacy" / "t"
    (legacy / MANIFEST).unlink()
    (legacy / SHARD.format(1)).write_bytes((legacy / SHARD.format(1)).read_bytes()[:1000])
    # killed while re-saving "t": the old folder moved aside, the new one not yet in place
    (root / "replaced" / "t").rename(replaced_folder(root / "replaced", "t"))


def load_damaged(base: str, stage: int) -> None:
    root, rank = Path(base), dist.get_rank()
    cases = {
        "truncated": (ValueError, rf"{SHARD.format(1)} is \d+ bytes, its manifest says \d+", {}),
        "missing": (FileNotFoundError, rf"{SHARD.format(0)} is missing", {}),
        "flipped": (ValueError, f"{SHARD.format(1)} does not match the CRC-32", {"verify": 1}),
        # no manifest: the rank reading the shard names it, the other stops with it
        "legacy": (
            (ValueError, f"cannot read checkpoint file .*{SHARD.format(1)}", {})
            if rank == 1
            else (RuntimeError, "another rank failed to load the optimizer state", {})
        ),
    }
    for case, (error, match, options) in cases.items():
        config = {"checkpoint": {"verify_checksums": True}} if options else {}
        engine = _engine(make_task("gpt", rows=8).build(), stage, zero=ZERO, **config)
        with pytest.raises(error, match=match):
            engine.load_checkpoint(str(root / case))
        engine.destroy()
    engine = _engine(make_task("gpt", rows=8).build(), stage, zero=ZERO)
    path, _ = engine.load_checkpoint(str(root / "replaced"))  # latest names "t"
    assert path is not None and ".t.replaced" in path and engine.global_steps == 1
    engine.destroy()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, 3], ids=["stage2", "stage3"])
def test_damaged_tags_are_named(dist_pool, tmp_path, stage):
    dist_pool(2).run(save_one, str(tmp_path / "source"), stage)
    _variants(tmp_path / "source", tmp_path)
    dist_pool(2).run(load_damaged, str(tmp_path), stage)
    # zero_to_fp32 checks the same way
    with pytest.raises(ValueError, match=rf"{SHARD.format(1)} is \d+ bytes"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "truncated")
    with pytest.raises(FileNotFoundError, match=f"{SHARD.format(0)} is missing"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "missing")
    get_fp32_state_dict_from_zero_checkpoint(tmp_path / "flipped")  # sizes only by default
    with pytest.raises(ValueError, match="does not match the CRC-32"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "flipped", verify_checksums=True)
    with pytest.raises(ValueError, match=f"cannot read checkpoint file .*{SHARD.format(1)}"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "legacy")
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "replaced")
    assert state["wte.weight"].dtype == torch.float32
