"""The 1-bit optimizers in the engine on 2 gloo ranks: no gradient all-reduce after the freeze,
exact checkpoint resume, refusals, convergence against the uncompressed optimizers."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.onebit.ranks import refused, train

BASE = {"lr": 3e-3, "eps": 1e-6}
CASES = {
    "OneBitAdam": ({**BASE, "freeze_step": 4}, 4),
    "ZeroOneAdam": ({**BASE, "var_freeze_step": 6, "var_update_scaler": 2}, 7),
    "OneBitLamb": ({**BASE, "freeze_step": 4, "coeff_beta": 0.5}, 4),
}


@pytest.mark.timeout(300)
def test_no_gradient_allreduce_after_freeze(dist_pool):
    pool = dist_pool(2)
    for kind, (params, frozen_from) in CASES.items():
        for record in pool.run(train, kind, params, 14):
            for step, volume in enumerate(record["volume"]):
                if step >= frozen_from:
                    assert not record["allreduce"][step], (kind, step)
                    assert "all_reduce" not in volume, (kind, step, volume)
                    assert "all_to_all_single" in volume, (kind, step)
            assert "all_reduce" in record["volume"][0]  # warm-up: gradients all-reduced
            losses = record["loss"]
            assert sum(losses[-3:]) < sum(losses[:3]), (kind, losses)


@pytest.mark.timeout(300)
def test_ranks_agree_after_compressed_steps(dist_pool):
    for kind, (params, _) in CASES.items():
        rank0, rank1 = dist_pool(2).run(train, kind, params, 10)
        for a, b in zip(rank0["params"][-1], rank1["params"][-1], strict=True):
            assert torch.equal(a, b), kind


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(CASES))
def test_checkpoint_resumes_exactly(dist_pool, tmp_path, kind):
    params, frozen_from = CASES[kind]
    pool = dist_pool(2)
    save_after = frozen_from + 3  # inside the compressed stage: the error buffers matter
    folder = str(tmp_path)
    whole = pool.run(train, kind, params, save_after + 3, save=(folder, save_after))
    resumed = pool.run(train, kind, params, 3, load=folder, start=save_after)
    for full, again in zip(whole, resumed, strict=True):
        for step in range(3):
            for a, b in zip(full["params"][save_after + step], again["params"][step], strict=True):
                assert torch.equal(a, b), (kind, step)
        assert again["allreduce"] == [False] * 3


@pytest.mark.timeout(300)
def test_refused_outside_stage_zero(dist_pool):
    pool = dist_pool(2)
    for stage in (1, 2, 3):
        for message in pool.run(
            refused, {"zero_optimization": {"stage": stage}}, "OneBitAdam", {"freeze_step": 2}
        ):
            assert "stage 0" in message and f"stage {stage}" in message
    for message in pool.run(refused, {}, "ZeroOneAdam", {"var_update_scaler": 0}):
        assert "var_update_scaler" in message


#: 200 steps (the loss falls from 5.5 to about 1.9): the compressed optimizers end 4-5% below
#: their references there (at 300 steps OneBitAdam ended 0.3% above Adam), and with the error
#: feedback off every one of them fails (2.8x, 3.9x, NaN)
STEPS = 200
CONVERGENCE = {
    # (compressed optimizer, its params) -> the uncompressed reference on the same stream
    "OneBitAdam": ({"freeze_step": 30}, "Adam"),
    "ZeroOneAdam": ({"var_freeze_step": 60, "var_update_scaler": 8}, "Adam"),
    "OneBitLamb": ({"freeze_step": 30, "coeff_beta": 0.9}, "Lamb"),
}


def _final(losses: list[float]) -> float:
    return sum(losses[-20:]) / 20  # the mean of the last 20 steps: less batch noise


@pytest.mark.timeout(600)
def test_convergence_within_two_percent(dist_pool):
    pool = dist_pool(2)
    # LAMB scales its steps by the trust ratio: it needs a larger lr to learn in 200 steps
    lr = {"Adam": {"lr": 3e-3, "eps": 1e-6}, "Lamb": {"lr": 2e-2, "eps": 1e-6}}
    reference = {name: _final(pool.run(train, name, lr[name], STEPS)[0]["loss"]) for name in lr}
    finals = {}
    for kind, (params, peer) in CONVERGENCE.items():
        finals[kind] = _final(pool.run(train, kind, {**lr[peer], **params}, STEPS)[0]["loss"])
        assert finals[kind] <= reference[peer] * 1.02, (kind, finals[kind], reference[peer])
    print(f"final losses: {reference} {finals}")


# 0/1 Adam whose local step interval grows to 4 quickly: steps 6-8 and 12 synchronise, steps
# 9-11 and 13 are local (the ranks' parameters differ after them)
LOCAL_STEPS = {
    **BASE,
    "var_freeze_step": 4,
    "var_update_scaler": 2,
    "local_step_scaler": 2,
    "local_step_clipper": 4,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", [{}, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_zero_one_adam_resumes_exactly_between_synchronisations(dist_pool, tmp_path, precision):
    # bf16: the optimizer steps fp32 masters, which the load first sets from rank 0's
    pool = dist_pool(2)
    save_after = 10  # after two local steps: the next synchronisation is step 12
    folder = str(tmp_path)
    whole = pool.run(
        train,
        "ZeroOneAdam",
        LOCAL_STEPS,
        save_after + 3,
        save=(folder, save_after),
        extra=precision,
    )
    at_save = [record["params"][save_after - 1] for record in whole]
    # the ranks really hold different parameters at the save (rank 0's alone would not do)
    assert any(not torch.equal(a, b) for a, b in zip(*at_save, strict=True))
    resumed = pool.run(
        train, "ZeroOneAdam", LOCAL_STEPS, 3, load=folder, start=save_after, extra=precision
    )
    for rank, (full, again) in enumerate(zip(whole, resumed, strict=True)):
        for step in range(3):
            for a, b in zip(full["params"][save_after + step], again["params"][step], strict=True):
                assert torch.equal(a, b), (rank, step)
        assert again["allreduce"] == [False] * 3
