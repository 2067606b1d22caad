"""AutoTP checkpoints: a tiny Llama (untied) and Qwen2 (tied head) saved at TP 2 x DP 2 ZeRO 1
after 3 steps resume at TP 2 x DP 2 ZeRO 2, at TP 4 ZeRO 3 and at TP 1 ZeRO 0 on one rank (a
plain model) and train 3 more steps exactly like the uninterrupted run; ``zero_to_fp32`` (the
function, the file writer, the command line and the script beside the checkpoint) gives the
whole model's parameters; a checkpoint whose tensor-parallel record disagrees with its files
is refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.checkpoint import consolidate
from shardspeed.checkpoint.manifest import MANIFEST
from shardspeed.checkpoint.tp_layout import PLAN_KEY, TP_KEY, TpLayoutError
from shardspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)
from tests.checkpoint import ckpt_autotp_ranks

pytest.importorskip("transformers")

TOL = 1e-5
#: (tp, stage) resumed in the 4-rank pool
FOUR_RANKS = [(2, 2), (4, 3)]
#: a split parameter of both models (4 query heads of 8 rows: 16 rows per rank at TP 2)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name, value in want.items():
        assert got[name].shape == value.shape, f"{what}: {name} {tuple(got[name].shape)}"
        diff = float((got[name].float() - value).abs().max() / value.abs().max())
        assert diff < TOL, f"{what}: {name} off by {diff:.2e}"


def _same_run(got: dict[str, Any], base: dict[str, Any], what: str) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], base["losses"], strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"{what}: loss of step {step + 4} {a} != {b}"
    _close(got["params"], base["params"], what)


def _load_record(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_autotp_checkpoint_resumes_at_other_sizes(dist_pool, tmp_path: Path, kind: str) -> None:
    save_dir = str(tmp_path / "ckpt")
    base = dist_pool(4).run(ckpt_autotp_ranks.save_and_continue, kind, save_dir, timeout_s=400)[0]
    tag = tmp_path / "ckpt" / "step3"
    files = sorted(p.name for p in tag.iterdir())
    for name in (
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "zero_pp_rank_1_mp_rank_01_optim_states.pt",
    ):
        assert name in files, f"{name} missing from {files}"
    # each tensor-parallel rank's own piece, and the record's split of it
    pieces = [_load_record(tag / f"mp_rank_0{t}_model_states.pt")["module"][Q_PROJ] for t in (0, 1)]
    assert pieces[0].shape == pieces[1].shape == (16, 32)
    assert not torch.equal(pieces[0], pieces[1])
    torch.testing.assert_close(torch.cat(pieces), base["saved"][Q_PROJ], rtol=0, atol=0)
    record = _load_record(tag / "mp_rank_00_model_states.pt")[PLAN_KEY][TP_KEY]
    assert record["size"] == 2
    assert record["params"][Q_PROJ] == {
        "full_shape": [32, 32],
        "dim": 0,
        "ranks": [[[0, 16]], [[16, 32]]],
    }

    resumed = dist_pool(4).run(
        ckpt_autotp_ranks.resume_cases, kind, save_dir, FOUR_RANKS, timeout_s=400
    )
    for rank_results in resumed:
        for (tp, stage), got in zip(FOUR_RANKS, rank_results, strict=True):
            what = f"{kind} resumed at tp={tp} stage={stage}"
            _close(got["loaded"], base["saved"], what + " (as loaded)")
            _same_run(got, base, what)
    alone = dist_pool(1).run(ckpt_autotp_ranks.resume, kind, save_dir, 1, 0, timeout_s=300)[0]
    _close(alone["loaded"], base["saved"], f"{kind} at tp=1 one rank (as loaded)")
    _same_run(alone, base, f"{kind} resumed at tp=1 stage=0 on one rank")

    # zero_to_fp32: the whole model's parameters, under its own keys
    whole = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="step3")
    _close(whole, base["saved"], f"{kind} zero_to_fp32")
    lazy = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="step3", lazy_mode=True)
    _close({k: v.contiguous() for k, v in lazy.items()}, base["saved"], f"{kind} lazy")
    out = tmp_path / "fp32"
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(out), tag="step3")
    _close(torch.load(out / "pytorch_model.bin"), base["saved"], f"{kind} file writer")
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    assert script.is_file()  # the standalone script beside the checkpoint (torch only)
    cli = tmp_path / "cli"
    subprocess.run(
        [sys.executable, str(script), save_dir, str(cli), "--tag", "step3"],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    _close(torch.load(cli / "pytorch_model.bin"), base["saved"], f"{kind} script")
    consolidate.main([save_dir, str(tmp_path / "main"), "--tag", "step3"])
    _close(torch.load(tmp_path / "main" / "pytorch_model.bin"), base["saved"], f"{kind} CLI")

    # a record whose layout disagrees with the files is refused, by load and by zero_to_fp32
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ckpt", bad)
    path = bad / "step3" / "mp_rank_00_model_states.pt"
    state = _load_record(path)
    state[PLAN_KEY][TP_KEY]["params"][Q_PROJ]["ranks"] = [[[0, 24]], [[24, 32]]]
    torch.save(state, path)
    (bad / "step3" / MANIFEST).unlink()  # the edit changes the file's size
    message = dist_pool(1).run(ckpt_autotp_ranks.load_error, kind, str(bad), 1, 0)[0]
    assert "tensor-parallel" in message and Q_PROJ in message, message
    with pytest.raises(ValueError, match="tensor-parallel") as refused:
        get_fp32_state_dict_from_zero_checkpoint(str(bad), tag="step3")
    assert Q_PROJ in str(refused.value)


def test_a_piece_of_another_shape_is_refused(tmp_path: Path) -> None:
    """Without any rank: a rank's file holding a tensor of another shape than the record gives
    that rank."""
    from shardspeed.checkpoint.tp_layout import TpRecord

    record = TpRecord.from_record(
        {
            "size": 2,
            "params": {"w": {"full_shape": [4, 3], "dim": 0, "ranks": [[[0, 2]], [[2, 4]]]}},
        },
        "test",
    )
    record.check_state({"w": torch.zeros(2, 3)}, 1, "f")
    with pytest.raises(TpLayoutError, match=r"holds 'w' with shape \[3, 3\]"):
        record.check_state({"w": torch.zeros(3, 3)}, 1, "f")
    with pytest.raises(TpLayoutError, match="do not tile"):
        TpRecord.from_record(
            {
                "size": 2,
                "params": {"w": {"full_shape": [4], "dim": 0, "ranks": [[[0, 3]], [[2, 4]]]}},
            },
            "test",
        )
    whole = torch.arange(12.0).view(4, 3)
    shared = TpRecord.from_record(  # two ranks sharing one piece (key/value heads)
        {
            "size": 3,
            "params": {
                "w": {"full_shape": [4, 3], "dim": 0, "ranks": [[[0, 2]], [[2, 4]], [[2, 4]]]}
            },
        },
        "test",
    )
    parts = [shared.splits["w"].take(whole, r) for r in range(3)]
    assert torch.equal(shared.assemble_state([{"w": p} for p in parts])["w"], whole)
