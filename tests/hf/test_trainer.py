"""The HF ``Trainer`` with ``TrainingArguments(deepspeed=...)`` on shardspeed, 2 ranks on CPU.

One launch per launcher (``shardspeed``, ``torchrun``, ``accelerate launch``) runs
``scripts/trainer_cases.py``: plain DDP, then ZeRO-2 and ZeRO-3 with ``"auto"`` configs, each
loading a saved tiny Llama with ``from_pretrained`` after its ``TrainingArguments`` exist,
training, saving with ``save_model()`` and resuming from a mid-run checkpoint. Under
``accelerate launch`` a fourth case takes DeepSpeed from the launcher's config file alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.hf.conftest import launch_cmd, rank_env, run_launched, run_plain

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hf_common import ds_config, write_json  # noqa: E402

CASES = ("ddp", "z2", "z3")
STEPS = ("1", "2", "3", "4")
RESUMED_FROM = 2
#: fp32 on CPU: DeepSpeed's reductions add in another order than DDP's
RTOL, ATOL = 1e-5, 1e-6


def _results(out: Path, cases: tuple[str, ...]) -> dict[str, list[dict]]:
    return {
        case: [json.loads((out / case / f"rank{r}.json").read_text()) for r in (0, 1)]
        for case in cases
    }


def _check_run(results: dict[str, list[dict]]) -> float:
    """Every assertion on one launch's results; returns the largest loss difference to DDP."""
    reference = results["ddp"][0]["losses"]
    assert sorted(reference) == list(STEPS)
    worst = 0.0
    for case, ranks in results.items():
        for rank, result in enumerate(ranks):
            assert result["env"]["RANK"] == str(rank) and result["env"]["WORLD_SIZE"] == "2"
            # the logged loss is gathered: both ranks saw the same curve
            assert result["losses"] == ranks[0]["losses"]
        result = ranks[0]
        want_engine = "DistributedDataParallel" if case == "ddp" else "DeepSpeedEngine"
        assert result["engine"] == want_engine, case
        for step in STEPS:
            assert result["losses"][step] == pytest.approx(reference[step], rel=RTOL, abs=ATOL)
            worst = max(worst, abs(result["losses"][step] - reference[step]))
        # resuming from checkpoint-2 recomputes steps 3 and 4 exactly
        for step in STEPS[RESUMED_FROM:]:
            assert result["resumed_losses"][step] == result["losses"][step], (case, step)
        assert result["resumed_score"] == result["score"], case
        assert result["score"] == pytest.approx(results["ddp"][0]["score"], rel=RTOL)
        # trainer.evaluate() through the engine (ZeRO-3 gathers in the forward), gathered
        assert ranks[1]["eval_loss"] == result["eval_loss"]
        assert result["eval_loss"] == pytest.approx(results["ddp"][0]["eval_loss"], rel=RTOL)
    for case in ("ddp", "z2"):
        for result in results[case]:
            assert result["loaded_bytes"]["held"] == result["loaded_bytes"]["full"]
    for case in [c for c in results if c.endswith("z3")]:
        for result in results[case]:
            # under ZeRO-3, from_pretrained left each rank only its shard of every module
            held, full = result["loaded_bytes"]["held"], result["loaded_bytes"]["full"]
            assert 0 < held <= full // 2 + 64 * 4 * 32, (case, held, full)
    return worst


def _check_saved(out: Path, results: dict[str, list[dict]], env: dict[str, str]) -> None:
    plain_env = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    scores = run_plain("score_saved.py", str(out), *results, env=plain_env)
    for case in results:
        # the safetensors save_model() wrote give the trained model's loss, bit for bit
        assert scores[case] == results[case][0]["score"], case
        if case != "ddp":  # and so do the weights zero_to_fp32 makes of the last checkpoint
            assert scores[f"{case}:zero_to_fp32"] == results[case][0]["score"], case


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torchrun", "shardspeed", "accelerate"])
def test_trainer_matches_ddp_saves_and_resumes(
    launcher: str, compat_site: Path, tmp_path: Path
) -> None:
    env = rank_env(compat_site)
    cases = CASES
    args = [str(tmp_path)]
    launcher_config = None
    if launcher != "torchrun":
        args.append("--config-file")  # a JSON path in TrainingArguments(deepspeed=...)
    if launcher == "accelerate":
        # and once with DeepSpeed from the launcher's config alone (no deepspeed= argument)
        cases = (*CASES, "launcher_z3")
        launcher_config = tmp_path / "accelerate_ds_config.json"
        write_json(launcher_config, ds_config(3, config_optimizer=True))
    args += ["--cases", ",".join(cases)]
    cmd = launch_cmd(launcher, "trainer_cases.py", *args, ds_config=launcher_config)
    run_launched(cmd, env, timeout=200)
    results = _results(tmp_path, cases)
    worst = _check_run(results)
    _check_saved(tmp_path, results, env)
    print(f"{launcher}: largest |loss - DDP loss| over {len(STEPS)} steps: {worst:.3g}")


@pytest.mark.timeout(180)
def test_readme_example_finetunes_and_saves(compat_site: Path, tmp_path: Path) -> None:
    from tests.hf.conftest import REPO

    example = REPO / "examples" / "hf_llama_finetune.py"
    cmd = launch_cmd("shardspeed", "unused.py")[:-1]  # the launcher's own flags
    cmd += [str(example), "--output_dir", str(tmp_path), "--max_steps", "4"]
    output = run_launched(cmd, rank_env(compat_site), timeout=170)
    assert "done: 4 steps" in output, output[-3000:]
    assert (tmp_path / "final" / "model.safetensors").is_file()
