"""Pipeline stages (``autotuning.pipeline_stages``) as a layout axis, without launches: the
layouts on 4 ranks, the batch triangle per layout, the ZeRO stages left out, memory per layout,
names, the mapping to the script (and its refusal), the model-based tuner's feature."""

from __future__ import annotations

import pytest

from shardspeed.autotuning.fit import (
    REPLICATED_ACTIVATIONS,
    ModelInfo,
    memory_needed,
    whole_model_info,
)
from shardspeed.autotuning.space import (
    AutotuningSpaceError,
    Point,
    apply_arg_mappings,
    build_space,
    experiment_config,
)
from shardspeed.autotuning.tuner import ModelBasedTuner, search
from shardspeed.config.autotuning import DeepSpeedAutotuningConfig

PP = "autotuning.pipeline_stages"
MAPS = {"arg_mappings": {PP: "--pipeline_stages"}}


def at(**kw: object) -> DeepSpeedAutotuningConfig:
    return DeepSpeedAutotuningConfig.from_dict(kw)


def layouts_of(config: dict[str, object], world: int, **kw: object) -> set[tuple[int, int, int]]:
    space = build_space(config, at(**MAPS, **kw), world)
    return {(p.tp_size, p.sp_size, p.pp_size) for p in space.points}


def test_layouts_with_pipeline_stages_on_four_ranks() -> None:
    tbs = {"train_batch_size": 16}
    assert layouts_of(tbs, 4, pipeline_stages="auto") == {(1, 1, 1), (1, 1, 2), (1, 1, 4)}
    assert layouts_of(tbs, 4, pipeline_stages=[2, 1]) == {(1, 1, 1), (1, 1, 2)}
    assert layouts_of(tbs, 4, pipeline_stages=4) == {(1, 1, 4)}  # a plain count: one value
    # with tp/sp tuned too: pipeline stages above 1 only where tp = sp = 1 (the pipeline engine
    # takes neither), and pp x tp x sp divides the world
    both = {**tbs, "tensor_parallel": {"autotp_size": "auto"}, "sequence_parallel_size": [1, 2]}
    assert layouts_of(both, 4, pipeline_stages="auto") == {
        (1, 1, 1), (1, 2, 1), (2, 1, 1), (4, 1, 1), (1, 1, 2), (1, 1, 4)
    }  # fmt: skip
    with pytest.raises(AutotuningSpaceError, match=r"values \[3\] do not divide the 4 ranks"):
        build_space(tbs, at(pipeline_stages=[1, 3], **MAPS), 4)
    with pytest.raises(AutotuningSpaceError, match="do not divide"):
        build_space(tbs, at(pipeline_stages=[0], **MAPS), 4)
    # a fixed tensor-parallel size leaves no room for a pipeline beside it
    with pytest.raises(AutotuningSpaceError, match="pipeline stages above 1 need tp and sp"):
        build_space(
            {**tbs, "tensor_parallel": {"autotp_size": [2]}}, at(pipeline_stages=[2], **MAPS), 4
        )
    # absent: not an axis, nothing about pipelines in the points
    assert {p.pp for p in build_space(tbs, at(), 4).points} == {None}


def test_batch_triangle_per_pipeline_layout() -> None:
    config = {"train_batch_size": 16, "zero_optimization": {"stage": 1}}
    space = build_space(
        config, at(pipeline_stages="auto", num_tuning_micro_batch_sizes=8, **MAPS), 4
    )
    by_pp: dict[int, set[tuple[int, int]]] = {}
    for p in space.points:
        dp = 4 // p.pp_size
        assert p.micro_batch * p.grad_accum * dp == 16  # train_batch = micro * accum * dp
        by_pp.setdefault(p.pp_size, set()).add((p.micro_batch, p.grad_accum))
    assert by_pp[1] == {(1, 4), (2, 2), (4, 1)}  # 4 data-parallel ranks: 4 samples each
    assert by_pp[2] == {(1, 8), (2, 4), (4, 2), (8, 1)}  # 2 data-parallel ranks
    assert by_pp[4] == {(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)}  # one copy of 4 stages
    # a layout whose data-parallel size does not divide the global batch is left out
    odd = build_space({**config, "train_batch_size": 2}, at(pipeline_stages="auto", **MAPS), 4)
    assert {p.pp_size for p in odd.points} == {2, 4}


def test_zero_stages_the_pipeline_engine_refuses_are_not_generated() -> None:
    tbs = {"train_batch_size": 8}
    # default stages 0-3: only 0 and 1 stay, at every stage count (the script builds a
    # PipelineModule at 1 stage too, which the engine refuses at ZeRO 2/3 as well)
    space = build_space(tbs, at(pipeline_stages=[1, 2], **MAPS), 2)
    assert {p.stage for p in space.points} == {0, 1}
    assert {(p.stage, p.pp_size) for p in space.points} == {(0, 1), (1, 1), (0, 2), (1, 2)}
    listed = build_space(
        {**tbs, "zero_optimization": {"stage": [1, 3]}}, at(pipeline_stages="auto", **MAPS), 2
    )
    assert {p.stage for p in listed.points} == {1}
    with pytest.raises(AutotuningSpaceError, match=r"only stages the pipeline engine refuses"):
        build_space(
            {**tbs, "zero_optimization": {"stage": [2, 3]}}, at(pipeline_stages="auto", **MAPS), 2
        )
    # without the pipeline axis every stage stays
    assert {p.stage for p in build_space(tbs, at(), 2).points} == {0, 1, 2, 3}


def test_the_stage_count_must_be_mapped_to_the_script() -> None:
    with pytest.raises(AutotuningSpaceError, match="arg_mappings does not map it") as err:
        build_space({"train_batch_size": 8}, at(pipeline_stages="auto"), 2)
    assert '"autotuning.pipeline_stages": "--pipeline_stages"' in str(err.value)  # the fix
    assert isinstance(err.value, AssertionError)  # DeepSpeed asserts on config mistakes
    # mapped: the value flag is given, replaced, or written as flag=N
    user = {"train_batch_size": 8, "autotuning": {"pipeline_stages": "auto"}}
    cfg = experiment_config(
        user, Point(1, 2, 2, pp=2), {"enabled": True, "pipeline_stages": "auto"}
    )
    assert cfg["autotuning"]["pipeline_stages"] == 2 and cfg["pipeline"] == {"stages": 2}
    assert DeepSpeedAutotuningConfig.from_dict(cfg["autotuning"]).pipeline_stages == 2
    args = ["--deepspeed_config", "c.json", "--pipeline_stages", "4"]
    assert apply_arg_mappings(args, {PP: "--pipeline_stages"}, cfg)[-2:] == [
        "--pipeline_stages", "2"
    ]  # fmt: skip
    assert apply_arg_mappings([], {PP: "--pp="}, cfg) == ["--pp=2"]


def test_names_gain_pp_only_when_it_is_tuned() -> None:
    assert Point(1, 2, 4, pp=2).name == "z1_pp2_mbs2_gas4"
    assert Point(0, 4, 1, pp=1).name == "z0_pp1_mbs4_gas1"
    assert Point(1, 4, 1, tp=1, sp=1, pp=2).name == "z1_tp1_sp1_pp2_mbs4_gas1"
    assert Point(1, 4, 1).name == "z1_mbs4_gas1"
    space = build_space({"train_batch_size": 8}, at(pipeline_stages=[1, 2], **MAPS), 2)
    assert all("_pp" in p.name for p in space.points)
    assert all("_pp" not in p.name for p in build_space({"train_batch_size": 8}, at(), 2).points)


# -- memory per layout ---------------------------------------------------------------------------
INFO = ModelInfo(num_params=1_000_000, largest_layer_params=10_000, activation_bytes_per_sample=1e6)


def test_pipeline_divides_model_states_and_keeps_micro_batches_in_flight() -> None:
    base = memory_needed(Point(0, 4, 4, pp=1), INFO, 4, mixed=False)
    assert base == 16_000_000 + 4_000_000  # fp32 Adam: 16 bytes a parameter, 1 MB a sample
    # 2 stages, 4 micro-batches a step: half the states; the first stage keeps 2 micro-batches
    # of half the layers in flight: the whole model's one micro-batch
    assert memory_needed(Point(0, 4, 4, pp=2), INFO, 4, mixed=False) == 8_000_000 + 4_000_000
    # one micro-batch a step: only that one is in flight, over half the layers
    assert memory_needed(Point(0, 4, 1, pp=2), INFO, 4, mixed=False) == 8_000_000 + 2_000_000
    # 4 stages, 2 micro-batches: 2 of 4 in flight, each a quarter of the layers
    assert memory_needed(Point(0, 4, 2, pp=4), INFO, 4, mixed=False) == 4_000_000 + 2_000_000
    # ZeRO-1 shards the stage's optimizer over its world / pp = 2 data-parallel ranks
    z1 = memory_needed(Point(1, 4, 4, pp=2), INFO, 4, mixed=False)
    assert z1 == int(500_000 * (4 + 4 + 8 / 2) + 4_000_000)
    # mixed precision, ZeRO-1: 2 + 2 bytes and 12 sharded over 2 ranks, on half the parameters
    mixed = memory_needed(Point(1, 4, 4, pp=2), INFO, 4, mixed=True)
    assert mixed == int(500_000 * (2 + 2 + 12 / 2) + 4_000_000)


def test_a_pipelined_profile_is_scaled_back_to_the_whole_model() -> None:
    measured = {"num_params": 500_000, "largest_layer_params": 5_000,
                "activation_bytes_per_sample": 1000.0}  # fmt: skip
    whole = whole_model_info(measured, Point(1, 2, 2, pp=2))
    assert whole["num_params"] == 1_000_000 and whole["largest_layer_params"] == 5_000
    assert whole["activation_bytes_per_sample"] == pytest.approx(2000.0)
    assert whole["profiled_layout"]["pp"] == 2
    # a TP 2 probe in a space that also tunes pp (pp 1 there)
    split = REPLICATED_ACTIVATIONS + (1 - REPLICATED_ACTIVATIONS) / 2
    tp2 = whole_model_info(measured, Point(1, 2, 2, tp=2, sp=1, pp=1))
    assert tp2["num_params"] == 1_000_000
    assert tp2["activation_bytes_per_sample"] == pytest.approx(1000.0 / split)


# -- the model-based tuner's feature -------------------------------------------------------------
def test_model_based_tuner_learns_the_pipeline_cost() -> None:
    config = {"train_batch_size": 32, "zero_optimization": {"stage": 1}}
    space = build_space(config, at(pipeline_stages="auto", **MAPS), 4)

    def speed(p: Point) -> float:  # bubbles cost; bigger micro-batches help
        return 100.0 * (1 - 1 / (1 + p.micro_batch)) / p.pp_size**0.7

    tuner = ModelBasedTuner(space.points, "throughput")
    trials = search(tuner, lambda p: (speed(p), p), 50, 0)
    assert len(trials) < len(space)
    assert max(speed(p) for p, _ in trials) == max(speed(p) for p in space.points)
    assert {p.pp_size for p, _ in trials} > {1}  # the axis was explored
    one, two = Point(1, 8, 1, pp=1), Point(1, 8, 2, pp=2)
    assert (tuner.predict(one) or 0.0) > (tuner.predict(two) or 0.0)  # priced as a cost
