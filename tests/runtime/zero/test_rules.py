"""The ZeRO rules table (``shardspeed.config.zero_rules``): each refusal is one rule, raised from
one place with its message, at config parse (the rules DeepSpeed applies there) and at
``initialize``; the stages a message names come from the one capability table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shardspeed
from shardspeed.config import DeepSpeedConfig, DeepSpeedConfigError, RootConfig
from shardspeed.config.errors import section_model
from shardspeed.config.zero_rules import (
    RULES,
    STAGE_CAPABILITIES,
    Capability,
    Setup,
    stages_with,
)
from shardspeed.runtime.zero.registry import STRATEGIES
from shardspeed.runtime.zero.rules import check_zero_config

_CPU = {"device": "cpu"}

#: rule name -> (a config that breaks it, whether the model is a pipeline, the exact message)
CASES: dict[str, tuple[dict[str, Any], bool, str]] = {
    "sum_reduction": (
        {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
        False,
        "gradient_allreduce_op='sum' is not supported with ZeRO stage 3; use "
        "gradient_allreduce_op 'mean', or set zero_optimization.stage to 0, 1 or 2",
    ),
    "sum_with_zenflow": (
        {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2, "zenflow": {}}},
        False,
        "gradient_allreduce_op='sum' is not supported with ZenFlow; use gradient_allreduce_op "
        "'mean', or remove zero_optimization.zenflow",
    ),
    "sum_with_deepcompile": (
        {"gradient_allreduce_op": "sum", "compile": {"deepcompile": True}},
        False,
        "gradient_allreduce_op='sum' is not supported with DeepCompile; use "
        "gradient_allreduce_op 'mean', or set compile.deepcompile to false",
    ),
    "offload_param": (
        {"zero_optimization": {"stage": 2, "offload_param": _CPU}},
        False,
        'zero_optimization.offload_param.device="cpu" needs ZeRO stage 3 (only stage 3 '
        "partitions the parameters; this is stage 2); set zero_optimization.stage to 3 or "
        'offload_param.device to "none"',
    ),
    "offload_optimizer": (
        {"zero_optimization": {"stage": 0, "offload_optimizer": _CPU}},
        False,
        'zero_optimization.offload_optimizer.device="cpu" needs ZeRO stage 1, 2 or 3 (the '
        "offloaded optimizer steps a partition; this is stage 0); set zero_optimization.stage "
        'or set offload_optimizer.device to "none"',
    ),
    "partial_offload": (
        {"zero_optimization": {"stage": 1, "offload_optimizer": {**_CPU, "ratio": 0.25}}},
        False,
        "zero_optimization.offload_optimizer.ratio=0.25 (partial offload) needs ZeRO stage 3, "
        "as in DeepSpeed (this is stage 1); set zero_optimization.stage to 3 or the ratio to "
        "1.0",
    ),
    "low_precision_masters": (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        False,
        "bf16.bf16_master_weights_and_grads is only supported with ZeRO stage 1, 2 or 3 "
        "(zero_optimization.stage is 0).",
    ),
    "zeropp_quantization": (
        {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
        False,
        "zero_optimization.zero_quantized_gradients=true (ZeRO++ quantization) quantizes the "
        "collectives of sharded parameters, which needs ZeRO stage 3 (got stage 2); set "
        "zero_optimization.stage to 3 or remove the key",
    ),
    "zeropp_hpz": (
        {"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 4}},
        False,
        "zero_optimization.zero_hpz_partition_size > 1 (ZeRO++ hierarchical partitioning) keeps "
        "a secondary shard of the sharded parameters, which needs ZeRO stage 3 (got stage 1); "
        "set zero_optimization.stage to 3 or zero_hpz_partition_size to 1",
    ),
    "mics": (
        {"zero_optimization": {"stage": 1, "mics_shard_size": 2}},
        False,
        "zero_optimization.mics_shard_size (MiCS) shards parameters, which needs ZeRO stage 3 "
        "(got stage 1); set stage 3 or remove mics_shard_size",
    ),
    "pipeline": (
        {"zero_optimization": {"stage": 2}},
        True,
        "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism (zero_optimization."
        "stage=2); use stage 0 or 1 with a PipelineModule",
    ),
}

#: a fragment of each rule's message, found in the table's source and nowhere else
_FRAGMENTS = (
    "is not supported with ZeRO stage",
    "is not supported with ZenFlow",
    "is not supported with DeepCompile",
    "partitions the parameters; this",
    "the offloaded optimizer steps a partition",
    "(partial offload) needs",
    "is only supported with ZeRO stage",
    "(ZeRO++ quantization)",
    "(ZeRO++ hierarchical partitioning)",
    "shards parameters, which needs",
    "ZeRO-2 and ZeRO-3 are incompatible",
)


def _unchecked(config: dict[str, Any]) -> RootConfig:
    """``config`` with each section validated on its own but no cross-section rule applied
    (what a config changed after parsing can hold)."""
    fields: dict[str, Any] = {}
    for key, value in config.items():
        model = section_model(RootConfig.model_fields[key].annotation)
        fields[key] = model.model_validate(value) if model is not None else value
    return RootConfig.model_construct(**fields)


def _with_stage(config: dict[str, Any], stage: int) -> dict[str, Any]:
    return {**config, "zero_optimization": {**config.get("zero_optimization", {}), "stage": stage}}


def test_every_rule_has_a_case() -> None:
    assert sorted(CASES) == sorted(rule.name for rule in RULES)
    assert len({rule.name for rule in RULES}) == len(RULES)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_each_refusal_is_raised_from_the_table(rule: Any) -> None:
    config, pipeline, message = CASES[rule.name]
    with pytest.raises(rule.error) as info:
        check_zero_config(_unchecked(config), pipeline=pipeline)
    assert str(info.value) == message
    raised_at = info.traceback[-1]
    assert (Path(str(raised_at.path)).name, raised_at.name) == ("zero_rules.py", "check")
    full = {"train_batch_size": 1, **config}
    if rule.at_config:  # DeepSpeed refuses it when parsing: so does DeepSpeedConfig, same words
        with pytest.raises(DeepSpeedConfigError) as parsed:
            DeepSpeedConfig(full)
        assert str(parsed.value) == message
    else:  # parses; refused at initialize
        DeepSpeedConfig(full)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_the_stages_named_are_the_stages_that_pass(rule: Any) -> None:
    config, pipeline, _ = CASES[rule.name]
    allowed = stages_with(rule.capability) if rule.capability is not None else []
    for stage in range(4):
        setup = Setup(_unchecked(_with_stage(config, stage)), pipeline=pipeline)
        if stage in allowed:
            rule.check(setup)
        else:
            with pytest.raises(rule.error):
                rule.check(setup)


def test_a_config_changed_after_parsing_is_refused_at_initialize() -> None:
    config = DeepSpeedConfig(
        {"train_batch_size": 1, "zero_optimization": {"stage": 3, "offload_param": _CPU}}
    )
    check_zero_config(config)
    config.zero_optimization.stage = 1  # type: ignore[assignment]
    with pytest.raises(DeepSpeedConfigError, match="offload_param.device.*needs ZeRO stage 3"):
        check_zero_config(config)


def test_nvme_folders_are_checked_at_initialize(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    for key in ("offload_param", "offload_optimizer"):
        zero = {"stage": 3, key: {"device": "nvme", "nvme_path": str(missing)}}
        config = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": zero})
        with pytest.raises(
            ValueError, match=f"zero_optimization.{key}.nvme_path=.*not an existing"
        ):
            check_zero_config(config)
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    check_zero_config(DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": zero}))


def test_one_capability_table_for_the_registered_strategies() -> None:
    assert sorted(STAGE_CAPABILITIES) == sorted(STRATEGIES)
    assert stages_with(Capability.optimizer_offload) == [1, 2, 3]
    assert stages_with(Capability.param_offload) == [3]
    assert stages_with(Capability.pipeline) == [0, 1]
    assert stages_with(Capability.quantized_collectives) == [3]


def test_no_refusal_is_written_twice() -> None:
    package = Path(shardspeed.__file__).parent
    table = package / "config" / "zero_rules.py"
    for fragment in _FRAGMENTS:
        holders = [p for p in package.rglob("*.py") if fragment in p.read_text()]
        assert holders == [table], (fragment, holders)
