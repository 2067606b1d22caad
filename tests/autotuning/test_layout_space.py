"""The parallel layout (tp x sp) and activation checkpointing axes, without launches: space
generation, the batch triangle per layout, memory per layout, names, script arguments, the
model-based tuner's features."""

from __future__ import annotations

import pytest

from shardspeed.autotuning.fit import (
    CHECKPOINTING_DIVISOR,
    REPLICATED_ACTIVATIONS,
    ModelInfo,
    fit_points,
    memory_needed,
    whole_model_info,
)
from shardspeed.autotuning.space import (
    AutotuningSpaceError,
    Point,
    apply_arg_mappings,
    build_space,
    experiment_config,
    layouts,
)
from shardspeed.autotuning.tuner import ModelBasedTuner, search
from shardspeed.config.autotuning import DeepSpeedAutotuningConfig

CKPT = "autotuning.activation_checkpointing"


def at(**kw: object) -> DeepSpeedAutotuningConfig:
    return DeepSpeedAutotuningConfig.from_dict(kw)


# -- space generation ----------------------------------------------------------------------------
def test_layouts_on_four_ranks() -> None:
    auto = {"tensor_parallel": {"autotp_size": "auto"}, "sequence_parallel_size": "auto"}
    # products dividing 4, and never tp and sp above 1 together (the engine refuses that)
    assert layouts(auto, 4) == [(1, 1), (1, 2), (1, 4), (2, 1), (4, 1)]
    assert layouts({"tensor_parallel": {"autotp_size": "auto"}}, 4) == [(1, 1), (2, 1), (4, 1)]
    assert layouts({"sequence_parallel_size": [2, 1]}, 4) == [(1, 1), (1, 2)]
    # a fixed size stays in the layout of the tuned one
    assert layouts(
        {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": "auto"}, 4
    ) == [(2, 1)]
    # absent (or plain values): the layout is not an axis, the config's stays untouched
    assert layouts({}, 4) == [(None, None)]
    assert layouts({"tensor_parallel": {"autotp_size": 2}}, 4) == [(None, None)]
    with pytest.raises(AutotuningSpaceError, match=r"values \[3\] do not divide the 4 ranks"):
        layouts({"tensor_parallel": {"autotp_size": [1, 3]}}, 4)


def test_batch_triangle_per_layout() -> None:
    config = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": "auto"},
        "sequence_parallel_size": [1, 2],
    }
    space = build_space(config, at(num_tuning_micro_batch_sizes=8), world_size=4)
    by_layout: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for p in space.points:
        dp = 4 // (p.tp_size * p.sp_size)
        assert p.micro_batch * p.grad_accum * dp == 16  # train_batch = micro * accum * dp
        by_layout.setdefault((p.tp_size, p.sp_size), set()).add((p.micro_batch, p.grad_accum))
    assert set(by_layout) == {(1, 1), (1, 2), (2, 1), (4, 1)}
    assert by_layout[(1, 1)] == {(1, 4), (2, 2), (4, 1)}  # 4 per data-parallel rank
    assert by_layout[(2, 1)] == by_layout[(1, 2)] == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert by_layout[(4, 1)] == {(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)}
    # a layout whose data-parallel size does not divide the global batch is left out
    odd = build_space({**config, "train_batch_size": 6}, at(), world_size=4)
    assert {(p.tp_size, p.sp_size) for p in odd.points} == {(1, 2), (2, 1), (4, 1)}


def test_checkpointing_axis_needs_a_mapping_and_a_fixed_value_is_kept() -> None:
    maps = {"arg_mappings": {CKPT: "--gradient_checkpointing"}}
    space = build_space({"train_batch_size": 8}, at(activation_checkpointing="auto", **maps), 2)
    assert {p.ckpt for p in space.points} == {False, True} and len(space) == 2 * 4 * 3
    listed = build_space({"train_batch_size": 8}, at(activation_checkpointing=[True], **maps), 2)
    assert {p.ckpt for p in listed.points} == {True}
    fixed = build_space({"train_batch_size": 8}, at(activation_checkpointing=True), 2)
    assert {p.ckpt for p in fixed.points} == {True}  # counted in memory; no mapping needed
    assert {p.ckpt for p in build_space({"train_batch_size": 8}, at(), 2).points} == {None}
    with pytest.raises(AutotuningSpaceError, match="arg_mappings does not map it"):
        build_space({"train_batch_size": 8}, at(activation_checkpointing="auto"), 2)


def test_names_show_the_layout_and_checkpointing() -> None:
    assert Point(3, 4, 1, tp=2, sp=1).name == "z3_tp2_sp1_mbs4_gas1"
    assert Point(0, 2, 2, tp=1, sp=4, ckpt=True).name == "z0_tp1_sp4_mbs2_gas2_ckpt"
    assert Point(2, 8, 1, "cpu", ckpt=False).name == "z2_mbs8_gas1_offcpu_nockpt"
    assert Point(1, 8, 1).name == "z1_mbs8_gas1"  # untuned axes stay out of the name


def test_experiment_config_carries_layout_and_checkpointing() -> None:
    user = {
        "train_batch_size": 16,
        "tensor_parallel": {"autotp_size": [1, 2], "preset_model": "llama"},
        "sequence_parallel_size": "auto",
        "autotuning": {"enabled": True, "activation_checkpointing": "auto"},
    }
    point = Point(1, 4, 2, tp=2, sp=1, ckpt=True)
    cfg = experiment_config(user, point, {"enabled": True, "activation_checkpointing": "auto"})
    assert cfg["tensor_parallel"] == {"autotp_size": 2, "preset_model": "llama"}
    assert cfg["sequence_parallel_size"] == 1
    assert cfg["autotuning"] == {"enabled": True, "activation_checkpointing": True}
    # the engine accepts the experiment's autotuning section
    assert DeepSpeedAutotuningConfig.from_dict(cfg["autotuning"]).activation_checkpointing is True


def test_checkpointing_reaches_the_script_as_a_flag_or_a_value() -> None:
    args = ["--deepspeed", "c.json", "--gradient_checkpointing", "false", "--x", "1"]
    on = apply_arg_mappings(args, {CKPT: "--gradient_checkpointing"}, {"autotuning": {
        "activation_checkpointing": True}})  # fmt: skip
    assert on == ["--deepspeed", "c.json", "--x", "1", "--gradient_checkpointing"]
    off = apply_arg_mappings(on, {CKPT: "--gradient_checkpointing"}, {CKPT: False})
    assert off == ["--deepspeed", "c.json", "--x", "1"]  # given only when on
    styled = apply_arg_mappings(off, {CKPT: "--ckpt="}, {CKPT: False})
    assert styled[-1] == "--ckpt=false"
    assert apply_arg_mappings(["--ckpt=false"], {CKPT: "--ckpt="}, {CKPT: True}) == ["--ckpt=true"]
    sized = apply_arg_mappings([], {"tensor_parallel.autotp_size": "--tp="}, {
        "tensor_parallel": {"autotp_size": 2}})  # fmt: skip
    assert sized == ["--tp=2"]


# -- memory per layout ---------------------------------------------------------------------------
INFO = ModelInfo(num_params=1_000_000, largest_layer_params=10_000, activation_bytes_per_sample=1e6)


def test_tensor_parallel_divides_model_states_and_part_of_the_activations() -> None:
    base = memory_needed(Point(0, 4, 1, tp=1, sp=1), INFO, 4, mixed=False)
    assert base == memory_needed(Point(0, 4, 1), INFO, 4, mixed=False) == 16_000_000 + 4_000_000
    tp2 = memory_needed(Point(0, 4, 1, tp=2, sp=1), INFO, 4, mixed=False)
    split = REPLICATED_ACTIVATIONS + (1 - REPLICATED_ACTIVATIONS) / 2
    assert tp2 == int(16_000_000 / 2 + 4_000_000 * split)
    # ZeRO-1 shards the optimizer over the world / tp = 2 data-parallel ranks of the TP 2 layout
    z1 = memory_needed(Point(1, 4, 1, tp=2, sp=1), INFO, 4, mixed=False)
    assert z1 == int(500_000 * (4 + 4 + 8 / 2) + 4_000_000 * split)


def test_sequence_parallel_divides_activations_and_shards_zero_over_its_ranks() -> None:
    sp2 = memory_needed(Point(3, 4, 1, tp=1, sp=2), INFO, 4, mixed=False)
    dp4 = memory_needed(Point(3, 4, 1, tp=1, sp=1), INFO, 4, mixed=False)
    assert dp4 - sp2 == 2_000_000  # same ZeRO-3 states over 4 ranks, half the activations


def test_checkpointing_divides_activations_unless_measured() -> None:
    off = memory_needed(Point(0, 4, 1, ckpt=False), INFO, 4, mixed=False)
    on = memory_needed(Point(0, 4, 1, ckpt=True), INFO, 4, mixed=False)
    assert off - on == int(4_000_000 * (1 - 1 / CHECKPOINTING_DIVISOR))
    measured = ModelInfo.from_dict(
        {
            "num_params": 1_000_000,
            "activation_bytes_per_sample": 1e6,
            "activation_bytes_per_sample_checkpointed": 1e5,
        }  # fmt: skip
    )
    assert memory_needed(Point(0, 4, 1, ckpt=True), measured, 4, mixed=False) == 16_400_000


def test_pruning_keeps_only_the_layouts_that_fit() -> None:
    points = [Point(0, 4, 1, tp=t, sp=s) for t, s in ((1, 1), (2, 1), (4, 1), (1, 4))]
    fits = fit_points(points, INFO, 4, mixed=False, limit=12_000_000)
    # tp 2: 8 MB + 2.6 MB; tp 4: 4 MB + 1.9 MB; sp 4: 16 MB + 1 MB
    assert [f.point.name for f in fits if f.fits] == [
        "z0_tp2_sp1_mbs4_gas1",
        "z0_tp4_sp1_mbs4_gas1",
    ]


def test_a_split_or_checkpointed_profile_is_scaled_back_to_the_whole_model() -> None:
    measured = {"num_params": 500_000, "largest_layer_params": 5_000,
                "activation_bytes_per_sample": 1000.0}  # fmt: skip
    whole = whole_model_info(measured, Point(0, 2, 1, tp=2, sp=1, ckpt=True))
    assert whole["num_params"] == 1_000_000 and whole["largest_layer_params"] == 10_000
    info = ModelInfo.from_dict(whole)
    # the estimate at the profiled point is what the profile measured there
    split = REPLICATED_ACTIVATIONS + (1 - REPLICATED_ACTIVATIONS) / 2
    assert info.activation_bytes_per_sample_checkpointed == pytest.approx(1000.0 / split)
    assert info.activation_bytes(Point(0, 1, 1, tp=2, sp=1, ckpt=True)) == pytest.approx(1000.0)
    assert info.activation_bytes(Point(0, 1, 1, tp=1, sp=2)) == pytest.approx(
        1000.0 / split * CHECKPOINTING_DIVISOR / 2
    )
    assert whole_model_info(measured, Point(0, 2, 1)) == {**measured, "profiled_layout": {
        "tp": 1, "sp": 1, "activation_checkpointing": False}}  # fmt: skip


# -- the model-based tuner's features ------------------------------------------------------------
def test_model_based_tuner_learns_the_layout_and_checkpointing() -> None:
    maps = {"arg_mappings": {CKPT: "--gc"}}
    config = {"train_batch_size": 32, "zero_optimization": {"stage": 0},
              "tensor_parallel": {"autotp_size": "auto"}}  # fmt: skip
    space = build_space(config, at(activation_checkpointing="auto", **maps), 4)

    def speed(p: Point) -> float:  # TP and checkpointing cost; bigger micro-batches help
        return 100.0 * (1 - 1 / (1 + p.micro_batch)) / p.tp_size**0.5 / (1.3 if p.ckpt else 1)

    tuner = ModelBasedTuner(space.points, "throughput")
    trials = search(tuner, lambda p: (speed(p), p), 50, 0)
    assert len(trials) < len(space) // 3
    assert max(speed(p) for p, _ in trials) == max(speed(p) for p in space.points)
    # trials vary each axis once; the fitted model prices TP and checkpointing as costs
    assert {p.tp_size for p, _ in trials} > {1} and {p.ckpt for p, _ in trials} == {False, True}
    fast, tp2, ckpt = (
        Point(0, 8, 1, tp=1, sp=1, ckpt=False),
        Point(0, 8, 1, tp=2, sp=1, ckpt=False),
        Point(0, 8, 1, tp=1, sp=1, ckpt=True),
    )
    price = {p: tuner.predict(p) or 0.0 for p in (fast, tp2, ckpt)}
    assert price[fast] > price[tp2] and price[fast] > price[ckpt]
