"""PyTorch Lightning's DeepSpeed path on shardspeed, and what ``zero_to_fp32`` hands its clients.

Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` (how Lightning users get weights out
of a DeepSpeed checkpoint) imports ``get_model_state_file`` and ``get_optim_files`` from
``deepspeed.utils.zero_to_fp32``, reads ``zero_stage`` from the first optimizer shard and, at
stage 3, the client state from ``zero_pp_rank_0_mp_rank_00_model_states.pt``. One ``torchrun``
launch (2 CPU ranks, the ``deepspeed`` compatibility package installed) trains a tiny tied-
embedding Llama with Lightning's ``DeepSpeedStrategy`` at ZeRO 2 and 3, saves, and converts
(``scripts/lightning_zero.py``); the converted weights must give the trained model's loss
exactly. DeepSpeed's own ``convert_zero_checkpoint_to_fp32_state_dict`` must keep tied weights
one tensor in a ``.bin`` (both names present), here and on DeepSpeed's fixtures.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint.files import (
    get_model_state_file,
    get_model_state_files,
    get_optim_files,
    zero3_model_states_name,
)
from shardspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)
from tests.hf.conftest import compat_site, free_port, rank_env, run_launched  # noqa: F401

SCRIPT = Path(__file__).parent / "scripts" / "lightning_zero.py"
FIXTURES = Path(__file__).parents[1] / "fixtures"
#: what Lightning's DeepSpeedStrategy puts into the client state (the model states file)
LIGHTNING_KEYS = {"epoch", "global_step", "loops", "callbacks", "pytorch-lightning_version"}
#: the tiny Llama's tied pair, under the LightningModule's ``model`` attribute
TIED = ("model.model.embed_tokens.weight", "model.lm_head.weight")


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")


def test_deepspeed_file_helpers(tmp_path: Path) -> None:
    """The file helpers of DeepSpeed's ``zero_to_fp32``, with its names and orders."""
    import shardspeed.utils.zero_to_fp32 as module

    for name in ("get_model_state_file", "get_optim_files", "get_model_state_files"):
        assert callable(getattr(module, name)), name
    ranks = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (10, 2, 0, 1)]
    _touch(tmp_path / "z2", "mp_rank_00_model_states.pt", *ranks)
    assert [Path(p).name for p in get_optim_files(tmp_path / "z2")] == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1, 2, 10)
    ]  # natural order: rank 10 last
    assert Path(get_model_state_file(tmp_path / "z2", 2)).name == "mp_rank_00_model_states.pt"
    # stage 3: rank 0's own model-states file, as DeepSpeed names it
    zero3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    _touch(tmp_path / "z3", "mp_rank_00_model_states.pt", zero3)
    assert Path(get_model_state_file(tmp_path / "z3", 3)).name == zero3
    assert len(get_model_state_files(tmp_path / "z3")) == 2
    # a stage 3 tag written before shardspeed wrote per-rank files: the one model-states file
    _touch(tmp_path / "old3", "mp_rank_00_model_states.pt")
    assert Path(get_model_state_file(tmp_path / "old3", 3)).name == "mp_rank_00_model_states.pt"
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        get_model_state_file(tmp_path / "nope", 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="can't find model states file"):
        get_model_state_file(tmp_path / "empty", 3)
    with pytest.raises(FileNotFoundError, match=r"can't find \*_optim_states.pt files"):
        get_optim_files(tmp_path / "empty")
    assert zero3_model_states_name(ranks[0]) == "zero_pp_rank_10_mp_rank_00_model_states.pt"
    # DeepSpeed's ZeRO-3 fixture (bf16 names its optimizer shards bf16_zero_pp_rank_*)
    ds3 = FIXTURES / "deepspeed_zero3_bf16" / "ds"
    assert Path(get_model_state_file(ds3, 3)).name == "zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert [Path(p).name for p in get_optim_files(ds3)] == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)
    ]


@pytest.mark.parametrize("fixture", ["deepspeed_zero2", "deepspeed_zero3"])
def test_tied_weights_stay_tied_in_the_bin(fixture: str, tmp_path: Path) -> None:
    """DeepSpeed's fixtures tie ``lm_head.weight`` to ``wte.weight``: one tensor under both names
    in the consolidated state dict and in ``pytorch_model.bin``; copies in safetensors."""
    root = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, root)
    state = get_fp32_state_dict_from_zero_checkpoint(root)
    assert state["lm_head.weight"] is state["wte.weight"]
    lazy = get_fp32_state_dict_from_zero_checkpoint(root, lazy_mode=True)
    assert lazy["lm_head.weight"] is lazy["wte.weight"]
    (path,) = convert_zero_checkpoint_to_fp32_state_dict(root, tmp_path / "bin")
    saved = torch.load(path, weights_only=True)
    assert saved["lm_head.weight"].data_ptr() == saved["wte.weight"].data_ptr()
    assert torch.equal(saved["wte.weight"], state["wte.weight"])
    # sharded: the tied pair stays in one file, counted once
    files = convert_zero_checkpoint_to_fp32_state_dict(root, tmp_path / "shards", "1KB")
    for shard in (f for f in files if f.suffix == ".bin"):
        part = torch.load(shard, weights_only=True)
        if "wte.weight" in part:
            assert part["lm_head.weight"].data_ptr() == part["wte.weight"].data_ptr()
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    (safe,) = convert_zero_checkpoint_to_fp32_state_dict(
        root, tmp_path / "safe", safe_serialization=True
    )
    loaded = load_file(str(safe))
    assert torch.equal(loaded["lm_head.weight"], loaded["wte.weight"])


@pytest.mark.timeout(240)
def test_lightning_checkpoint_converts(compat_site: Path, tmp_path: Path) -> None:  # noqa: F811
    pytest.importorskip("lightning")
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", port, str(SCRIPT), str(tmp_path), "--stages", "2,3"]  # fmt: skip
    run_launched(cmd, rank_env(compat_site), timeout=220)
    for stage in (2, 3):
        result = json.loads((tmp_path / f"stage{stage}.json").read_text())
        # Lightning's converter gave the weights the job trained, bit for bit
        assert result["converted"] == result["trained"], result
        assert result["global_step"] == 3
        keys = set(result["client_keys"])
        assert LIGHTNING_KEYS | {"state_dict"} <= keys and not keys & {"module", "optimizer"}
        # DeepSpeed's names: one model-states file per rank at stage 3
        per_rank = {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)}
        assert (per_rank <= set(result["files"])) == (stage == 3), result["files"]
        tag = tmp_path / f"stage{stage}.ckpt" / "checkpoint"
        for shard in get_optim_files(tag):
            saved = torch.load(shard, weights_only=False)["optimizer_state_dict"]
            assert saved["zero_stage"] == stage and saved["partition_count"] == 2
        saved = torch.load(tmp_path / f"stage{stage}-bin" / "pytorch_model.bin", weights_only=True)
        assert saved[TIED[0]].data_ptr() == saved[TIED[1]].data_ptr()
        assert (tmp_path / f"stage{stage}-safe" / "model.safetensors").is_file()
    # the per-rank files hold the client state, not the weights
    rank1 = torch.load(
        tmp_path / "stage3.ckpt" / "checkpoint" / "zero_pp_rank_1_mp_rank_00_model_states.pt",
        weights_only=False,
    )
    assert LIGHTNING_KEYS <= set(rank1) and rank1["module"] == {} and rank1["zero_stage"] == 3
