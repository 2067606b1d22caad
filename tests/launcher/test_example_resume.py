"""The README's example, launched as a user would: train on 2 ranks and save, resume on 1 rank.

The checkpoint re-partitions from 2 ranks to 1 (and from bf16 ZeRO 2, or ZeRO 3, to fp32 ZeRO 0 in
the other cases), and training picks up at the saved step with the loss where the first job left it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import REPO, free_port, run_shardspeed

EXAMPLE = str(REPO / "examples" / "train_gpt.py")


def _train(ranks: int, config: str, save_dir: Path, *extra: str) -> str:
    result = run_shardspeed(
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(free_port()),
        EXAMPLE,
        "--deepspeed_config",
        str(REPO / "examples" / config),
        "--steps",
        "5",
        "--save_dir",
        str(save_dir),
        *extra,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "first,second",
    [
        ("gpt_config.json", "gpt_config.json"),
        ("gpt_zero2_bf16_config.json", "gpt_config.json"),
        ("gpt_zero3_config.json", "gpt_config.json"),
    ],
    ids=["same-config", "zero2-bf16-to-config", "zero3-to-config"],
)
def test_save_on_two_ranks_resume_on_one(tmp_path: Path, first: str, second: str) -> None:
    out = _train(2, first, tmp_path)
    last = float(re.search(r"loss [\d.]+ -> ([\d.]+)", out).group(1))
    assert (tmp_path / "latest").read_text() == "global_step5"
    resumed = _train(1, second, tmp_path, "--resume")
    assert "global_step5/mp_rank_00_model_states.pt at step 5" in resumed, resumed
    # the step counter carries on from the checkpoint's step
    first_after = float(re.search(r"step +6 +loss ([\d.]+)", resumed).group(1))
    # the next batch's loss, from the trained weights: near where training stopped, far below
    # the untrained model's (~5.56)
    assert abs(first_after - last) < 0.1 and first_after < 5.5, (last, first_after)
    assert (tmp_path / "latest").read_text() == "global_step10"


@pytest.mark.timeout(300)
def test_moe_example_saves_with_experts_split_and_resumes_on_one_rank(tmp_path: Path) -> None:
    """The example with MoE feed-forwards, 4 experts split over 2 ranks (ep_size 2), saves in
    DeepSpeed's expert layout and resumes on 1 rank with every expert local (ep_size 1)."""
    moe = ("--moe_experts", "4")
    out = _train(2, "gpt_config.json", tmp_path, *moe, "--ep_size", "2")
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert (tmp_path / "global_step5" / "layer_0_expert_3_mp_rank_00_model_states.pt").is_file()
    resumed = _train(1, "gpt_config.json", tmp_path, *moe, "--ep_size", "1", "--resume")
    first_after = float(re.search(r"step +6 +loss ([\d.]+)", resumed).group(1))
    # where the first job stopped, below where it started
    assert abs(first_after - last) < 0.1 and first_after < first, (first, last, first_after)
