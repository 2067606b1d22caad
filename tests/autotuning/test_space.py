"""Config parsing, search-space generation, memory pruning and the tuners, without launches
(cases after DeepSpeed's tests/unit/autotuning/test_autotuning.py)."""

from __future__ import annotations

import math

import pytest

from shardspeed.autotuning.fit import ModelInfo, fit_points, memory_needed
from shardspeed.autotuning.space import (
    AutotuningSpaceError,
    Point,
    apply_arg_mappings,
    build_space,
    config_path_in_args,
    experiment_config,
    replace_config_path,
)
from shardspeed.autotuning.tuner import ModelBasedTuner, make_tuner, search
from shardspeed.config.autotuning import DeepSpeedAutotuningConfig
from shardspeed.config.errors import DeepSpeedConfigError


def at(**kw: object) -> DeepSpeedAutotuningConfig:
    return DeepSpeedAutotuningConfig.from_dict(kw)


# -- config parsing ------------------------------------------------------------------------------
def test_autotuning_section_defaults_are_deepspeeds() -> None:
    cfg = at()
    assert (cfg.enabled, cfg.fast, cfg.metric, cfg.tuner_type) == (
        False,
        True,
        "throughput",
        "gridsearch",
    )
    assert (cfg.results_dir, cfg.exps_dir, cfg.overwrite) == (
        "autotuning_results",
        "autotuning_exps",
        True,
    )
    assert (cfg.start_profile_step, cfg.end_profile_step) == (3, 5)
    assert (cfg.tuner_early_stopping, cfg.tuner_num_trials) == (5, 50)
    assert cfg.num_tuning_micro_batch_sizes == 3 and cfg.arg_mappings is None


@pytest.mark.parametrize(
    "section",
    [{"metric": "speed"}, {"tuner_type": "bayes"}, {"tuner_num_trials": 0}, {"memory_limit_gb": 0}],
)
def test_bad_autotuning_values_are_refused(section: dict[str, object]) -> None:
    with pytest.raises(DeepSpeedConfigError, match=next(iter(section))):
        at(**section)


def test_arg_mappings_and_model_info_parse() -> None:
    cfg = at(
        arg_mappings={"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"},
        model_info={"num_params": 10},
        memory_limit_gb=1.5,
    )
    assert cfg.arg_mappings == {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}
    assert cfg.model_info == {"num_params": 10} and cfg.memory_limit_gb == 1.5


# -- experiment generation -----------------------------------------------------------------------
def test_fixed_global_batch_gives_divisor_micro_batches_and_matching_accumulation() -> None:
    space = build_space({"train_batch_size": 32}, at(), world_size=2)
    assert space.train_batch_size == 32 and space.dp_world == 2
    # divisors of the per-rank batch 16, 3 of them spread geometrically; 4 stages
    assert sorted({(p.micro_batch, p.grad_accum) for p in space.points}) == [
        (1, 16),
        (4, 4),
        (16, 1),
    ]
    assert {p.stage for p in space.points} == {0, 1, 2, 3} and len(space) == 12
    for p in space.points:
        assert p.micro_batch * p.grad_accum * 2 == 32


def test_list_auto_and_fixed_values() -> None:
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"}
    listed = build_space({**base, "zero_optimization": {"stage": [0, 2]}}, at(), 2)
    assert {p.stage for p in listed.points} == {0, 2}
    fixed = build_space({**base, "zero_optimization": {"stage": 1}}, at(), 2)
    assert {p.stage for p in fixed.points} == {1}
    auto = build_space({**base, "zero_optimization": {"stage": "auto"}}, at(), 2)
    assert {p.stage for p in auto.points} == {0, 1, 2, 3}
    micro = build_space({"train_batch_size": 16, "train_micro_batch_size_per_gpu": [2, 8]}, at(), 2)
    assert sorted({(p.micro_batch, p.grad_accum) for p in micro.points}) == [(2, 4), (8, 1)]


def test_without_global_batch_micro_batches_are_powers_of_two() -> None:
    cfg = at(min_train_micro_batch_size_per_gpu=2, max_train_micro_batch_size_per_gpu=32)
    space = build_space(
        {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 0}}, cfg, 4
    )
    assert [(p.micro_batch, p.grad_accum) for p in space.points] == [(2, 2), (8, 2), (32, 2)]


def test_slow_space_adds_offload_and_buckets_but_not_at_stage_0() -> None:
    space = build_space(
        {"train_batch_size": 8, "zero_optimization": {"stage": [0, 2]}},
        at(fast=False, num_tuning_micro_batch_sizes=1),
        2,
    )
    # stage 0: 1 point; stage 2: offload {none, cpu} x buckets {5e7, 5e8}
    assert len(space) == 5
    names = {p.name for p in space.points}
    assert "z0_mbs4_gas1" in names and "z2_mbs4_gas1_offcpu_b5e+07" in names


def test_nvme_joins_the_slow_space_where_a_path_is_set(tmp_path) -> None:
    swap = str(tmp_path)
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    config["zero_optimization"]["offload_optimizer"] = {"nvme_path": swap}
    space = build_space(config, at(fast=False, num_tuning_micro_batch_sizes=1), 2)
    assert {p.offload for p in space.points} == {"none", "cpu", "nvme"}
    nvme = next(p for p in space.points if p.offload == "nvme")
    trial = experiment_config(config, nvme, None)["zero_optimization"]["offload_optimizer"]
    assert trial == {"device": "nvme", "nvme_path": swap}
    # no path: no NVMe trial by default, and listing it is an error naming the fix
    plain = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    assert "nvme" not in {p.offload for p in build_space(plain, at(fast=False), 2).points}
    listed = {**plain, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": ["nvme"]}}}
    with pytest.raises(
        AutotuningSpaceError, match="set zero_optimization.offload_optimizer.nvme_path"
    ):
        build_space(listed, at(), 2)
    with pytest.raises(AutotuningSpaceError, match="not offload devices"):
        build_space(
            {**plain, "zero_optimization": {"offload_optimizer": {"device": ["gpu"]}}}, at(), 2
        )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train_batch_size": 15}, "not divisible by the 2 data-parallel"),
        ({"train_batch_size": 8, "zero_optimization": {"stage": [5]}}, "not ZeRO stages"),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": [3]}, "divides the per-rank"),
    ],
)
def test_impossible_spaces_are_named(config: dict[str, object], message: str) -> None:
    with pytest.raises(AutotuningSpaceError, match=message):
        build_space(config, at(), 2)
    assert issubclass(AutotuningSpaceError, AssertionError)


def test_experiment_config_sets_the_point_and_keeps_the_rest() -> None:
    user = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [0, 3], "overlap_comm": True},
    }
    point = Point(3, 4, 4, "cpu", 50_000_000)
    cfg = experiment_config(user, point, {"enabled": True, "metric_path": "/x/m.json"})
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": True,
        "offload_optimizer": {"device": "cpu"},
        "stage3_prefetch_bucket_size": 50_000_000,
    }
    assert cfg["optimizer"] == user["optimizer"] and cfg["autotuning"]["metric_path"] == "/x/m.json"
    assert user["zero_optimization"]["stage"] == [0, 3]  # the user's dict is untouched
    assert "autotuning" not in experiment_config(user, point, None)


def test_config_path_and_arg_mappings_in_script_arguments() -> None:
    args = ["--steps", "3", "--deepspeed_config", "a.json", "--per_device_train_batch_size", "8"]
    assert config_path_in_args(args) == "a.json"
    assert config_path_in_args(["--deepspeed=b.json"]) == "b.json"
    assert replace_config_path(args, "/e/c.json")[3] == "/e/c.json"
    assert replace_config_path(["--deepspeed=b.json"], "/e/c.json") == ["--deepspeed=/e/c.json"]
    with pytest.raises(AutotuningSpaceError, match="--deepspeed_config cfg.json"):
        replace_config_path(["--steps", "3"], "/e/c.json")
    mapped = apply_arg_mappings(
        args,
        {
            "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps",
        },
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
    )
    assert mapped[-4:] == [
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "4",
    ]


# -- memory pruning ------------------------------------------------------------------------------
def test_memory_estimate_orders_stages_and_grows_with_micro_batch() -> None:
    info = ModelInfo(
        num_params=1_000_000, largest_layer_params=10_000, activation_bytes_per_sample=1e6
    )
    need = {s: memory_needed(Point(s, 4, 1), info, 4, mixed=False) for s in range(4)}
    assert need[0] > need[1] > need[2] > need[3]
    assert need[0] == 16_000_000 + 4_000_000  # fp32 params, grads, Adam; 4 samples
    assert memory_needed(Point(1, 4, 1, "cpu"), info, 4, False) < need[1]
    assert memory_needed(Point(0, 8, 1), info, 4, False) - need[0] == 4_000_000
    # mixed precision ZeRO-2 follows the documented estimator (4P + 16P/N)
    assert memory_needed(Point(2, 1, 1), info, 4, mixed=True) == 4_000_000 + 4_000_000 + 1_000_000
    fits = fit_points([Point(0, 4, 1), Point(3, 4, 1)], info, 4, False, limit=10_000_000)
    assert [f.fits for f in fits] == [False, True]


# -- tuners --------------------------------------------------------------------------------------
def _synthetic(point: Point) -> float:
    """Samples/s of a made-up job: per-micro-step overhead, and slower ZeRO stages / offload."""
    per_sample = 1.0 + 8.0 / point.micro_batch
    per_sample *= 1.0 + 0.15 * point.stage + (0.5 if point.offload != "none" else 0.0)
    return 100.0 / per_sample


def test_model_based_finds_the_best_in_a_third_of_the_grid() -> None:
    space = build_space({"train_batch_size": 64}, at(num_tuning_micro_batch_sizes=5), 2)
    grid = search(
        make_tuner("gridsearch", space.points, "throughput"), lambda p: (_synthetic(p), p), 100, 0
    )
    assert len(grid) == len(space) == 20
    best = max(_synthetic(p) for p, _ in grid)
    tuner = ModelBasedTuner(space.points, "throughput")
    trials = search(tuner, lambda p: (_synthetic(p), p), len(space) // 3, 5)
    assert len(trials) <= len(space) // 3
    assert max(_synthetic(p) for p, _ in trials) >= 0.95 * best
    assert tuner.weights is not None and tuner.predict(Point(0, 32, 1)) is not None


def test_early_stopping_and_failures() -> None:
    points = [Point(0, m, 1) for m in (1, 2, 4, 8, 16)]
    # the first trial is the best; two more without improvement stop the grid
    values = {1: 10.0, 2: 5.0, 4: 4.0, 8: 3.0, 16: 2.0}
    trials = search(
        make_tuner("gridsearch", points, "throughput"), lambda p: (values[p.micro_batch], 0), 50, 2
    )
    assert len(trials) == 3
    # failed experiments (None) count as no improvement but never stop the search by raising
    failing = search(make_tuner("random", points, "throughput"), lambda p: (None, 0), 50, 0)
    assert len(failing) == 5
    # latency is minimized
    tuner = make_tuner("gridsearch", points, "latency")
    assert tuner.better(1.0, 2.0) and not tuner.better(2.0, 1.0)
    assert not math.isnan(_synthetic(points[0]))


def test_model_based_explores_each_axis_before_trusting_its_model() -> None:
    space = build_space({"train_batch_size": 32}, at(), 2)  # 4 stages x micro-batch 1, 4, 16
    measured = {  # samples/s as measured on 2 CPU ranks (example GPT)
        (0, 16): 772, (1, 16): 731, (2, 16): 600, (3, 16): 260, (0, 4): 215, (1, 4): 200,
        (2, 4): 180, (3, 4): 50, (0, 1): 150, (1, 1): 140, (2, 1): 120, (3, 1): 16,
    }  # fmt: skip
    tuner = ModelBasedTuner(space.points, "throughput")
    trials = search(tuner, lambda p: (measured[p.stage, p.micro_batch], p), 50, 5)
    # the prior's first pick; another micro-batch; another stage; then the model stops the search
    assert [p.name for p, _ in trials] == ["z0_mbs16_gas1", "z0_mbs4_gas4", "z1_mbs16_gas1"]
    assert tuner.done_early(772.0)
