"""Every "X is not supported with ZeRO stage Y" of shardspeed, as one table of rules.

What each ZeRO stage can do is one table, :data:`STAGE_CAPABILITIES` (stage -> its
:class:`Capability` set; the strategy registered for the stage implements exactly those). A
:class:`Rule` names what a config asks for (``asked``: the key and its value as the message
shows them, or None when it asks nothing of the kind) and the capability the configured stage
must have; its message names the key, the stages that can do it (read off the table, so the
two cannot disagree) and the fix. A rule with no capability refuses a combination that no stage
supports.

The rules DeepSpeed applies when it parses a config (``at_config``) run in
:class:`~shardspeed.config.DeepSpeedConfig`'s validation (:func:`check_config_rules`); every
rule runs once more at ``initialize`` (:func:`check_rules`, from
:func:`shardspeed.runtime.zero.rules.check_zero_config`), where the config may have been
changed since and where the run's other parallelisms (a pipeline) are known. Either way the
same rule raises the same message. This is layer 0: the table is about the config's stages, so
the config can apply it without reaching up to the strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from shardspeed.config.errors import DeepSpeedConfigError

if TYPE_CHECKING:
    from shardspeed.config.root import RootConfig

__all__ = [
    "RULES",
    "STAGE_CAPABILITIES",
    "Capability",
    "Rule",
    "Setup",
    "check_config_rules",
    "check_rules",
    "stages_with",
]


class Capability(str, Enum):
    """Something a ZeRO stage can do that a config may ask for."""

    #: ``offload_optimizer``: the masters and optimizer state in host memory or on NVMe
    optimizer_offload = "optimizer_offload"
    #: ``offload_optimizer.ratio`` below 1: only part of the masters offloaded
    partial_offload = "partial_offload"
    #: ``offload_param``: parameter shards in host memory or on NVMe between uses
    param_offload = "param_offload"
    #: ``mics_shard_size``: parameters sharded within groups of fewer ranks
    mics = "mics"
    #: ``gradient_allreduce_op: "sum"``: gradients added over the ranks, not averaged
    sum_reduction = "sum_reduction"
    #: ``fp16.fp16_master_weights_and_grads``, ``bf16.bf16_master_weights_and_grads``,
    #: ``bf16.bf16_optimizer_states``: accepted where DeepSpeed accepts them
    low_precision_masters = "low_precision_masters"
    #: a ``PipelineModule``: the pipeline engine accumulates whole gradients per stage
    pipeline = "pipeline"
    #: ZeRO++ quantized weights and gradients (qwZ, qgZ): collectives of sharded parameters
    quantized_collectives = "quantized_collectives"
    #: ZeRO++ hierarchical partitioning (hpZ, ``zero_hpz_partition_size``): a secondary shard
    #: of sharded parameters
    hpz = "hpz"


_C = Capability

#: what each ZeRO stage can do (stage 0 partitions nothing, so it has nothing to offload; stage
#: 2's partitioned gradients do not fit the pipeline's accumulation; stage 3 shards the
#: parameters, and always averages, as DeepSpeed's does)
STAGE_CAPABILITIES: dict[int, frozenset[Capability]] = {
    0: frozenset({_C.sum_reduction, _C.pipeline}),
    1: frozenset({_C.optimizer_offload, _C.sum_reduction, _C.low_precision_masters, _C.pipeline}),
    2: frozenset({_C.optimizer_offload, _C.sum_reduction, _C.low_precision_masters}),
    3: frozenset(
        {
            _C.optimizer_offload,
            _C.partial_offload,
            _C.param_offload,
            _C.mics,
            _C.low_precision_masters,
            _C.quantized_collectives,
            _C.hpz,
        }
    ),
}


@dataclass(frozen=True)
class Setup:
    """What a run asks of its ZeRO stage: the config and the parallelisms around it."""

    config: RootConfig
    #: the model is a ``PipelineModule``
    pipeline: bool = False


@dataclass(frozen=True)
class Rule:
    """One refusal (see the module docstring)."""

    #: a short name, for tests and the docs
    name: str
    #: what ``setup`` asks for, as the message names it (``offload_param.device="cpu"``), or
    #: None when it does not ask for it
    asked: Callable[[Setup], str | None]
    #: what the configured stage must be able to do; None: no stage can
    capability: Capability | None
    #: the message; ``{asked}``, ``{stage}`` (the configured stage) and ``{stages}`` (those
    #: that have the capability, "1, 2 or 3") are filled in
    message: str
    #: the exception raised (a ``NotImplementedError`` for what shardspeed lacks yet)
    error: type[Exception] = DeepSpeedConfigError
    #: whether ``DeepSpeedConfig`` refuses it when the config is parsed, as DeepSpeed does
    at_config: bool = False

    def check(self, setup: Setup) -> None:
        """Raise this rule's error if ``setup`` asks for what its stage cannot do."""
        asked = self.asked(setup)
        if asked is None:
            return
        stage = int(setup.config.zero_optimization.stage)
        stages = stages_with(self.capability) if self.capability is not None else []
        if stage in stages:
            return
        raise self.error(self.message.format(asked=asked, stage=stage, stages=_spoken(stages)))


def stages_with(capability: Capability) -> list[int]:
    """The ZeRO stages that have ``capability``, in order."""
    return [stage for stage, can in sorted(STAGE_CAPABILITIES.items()) if capability in can]


def _spoken(stages: list[int]) -> str:
    """``[1, 2, 3]`` as "1, 2 or 3"."""
    words = [str(s) for s in stages]
    if len(words) < 2:
        return "".join(words)
    return f"{', '.join(words[:-1])} or {words[-1]}"


def _zeropp_quantization(setup: Setup) -> str | None:
    zero = setup.config.zero_optimization
    flags = (
        ("zero_quantized_weights", zero.zero_quantized_weights),
        ("zero_quantized_gradients", zero.zero_quantized_gradients),
        ("zero_quantized_nontrainable_weights", zero.zero_quantized_nontrainable_weights),
    )
    return next((key for key, enabled in flags if enabled), None)


def _offload_param(setup: Setup) -> str | None:
    section = setup.config.zero_optimization.offload_param
    if section is None or not section.enabled:
        return None
    return f'zero_optimization.offload_param.device="{section.device.value}"'


def _offload_optimizer(setup: Setup) -> str | None:
    section = setup.config.zero_optimization.offload_optimizer
    if section is None or not section.enabled:
        return None
    return f'zero_optimization.offload_optimizer.device="{section.device.value}"'


def _partial_offload(setup: Setup) -> str | None:
    section = setup.config.zero_optimization.offload_optimizer
    if section is None or section.ratio >= 1.0:
        return None
    return f"zero_optimization.offload_optimizer.ratio={section.ratio}"


def _sum_reduction(setup: Setup) -> str | None:
    return "gradient_allreduce_op='sum'" if setup.config.gradient_allreduce_op == "sum" else None


def _sum_with(active: Callable[[RootConfig], bool]) -> Callable[[Setup], str | None]:
    def asked(setup: Setup) -> str | None:
        return _sum_reduction(setup) if active(setup.config) else None

    return asked


def _low_precision_masters(setup: Setup) -> str | None:
    config = setup.config
    flags = (
        ("fp16.fp16_master_weights_and_grads", config.fp16.fp16_master_weights_and_grads),
        ("bf16.bf16_master_weights_and_grads", config.bf16.bf16_master_weights_and_grads),
        ("bf16.bf16_optimizer_states", config.bf16.bf16_optimizer_states),
    )
    return next((key for key, enabled in flags if enabled), None)


#: every rule, in the order they are checked
RULES: tuple[Rule, ...] = (
    Rule(
        "sum_reduction",
        _sum_reduction,
        _C.sum_reduction,
        "{asked} is not supported with ZeRO stage {stage}; use gradient_allreduce_op 'mean', "
        "or set zero_optimization.stage to {stages}",
        at_config=True,
    ),
    Rule(
        "sum_with_zenflow",
        _sum_with(lambda config: config.zero_optimization.zenflow is not None),
        None,
        "{asked} is not supported with ZenFlow; use gradient_allreduce_op 'mean', or remove "
        "zero_optimization.zenflow",
        at_config=True,
    ),
    Rule(
        "sum_with_deepcompile",
        _sum_with(lambda config: config.compile.deepcompile),
        None,
        "{asked} is not supported with DeepCompile; use gradient_allreduce_op 'mean', or set "
        "compile.deepcompile to false",
        at_config=True,
    ),
    Rule(
        "offload_param",
        _offload_param,
        _C.param_offload,
        "{asked} needs ZeRO stage {stages} (only stage {stages} partitions the parameters; this "
        "is stage {stage}); set zero_optimization.stage to {stages} or offload_param.device to "
        '"none"',
        at_config=True,
    ),
    Rule(
        "offload_optimizer",
        _offload_optimizer,
        _C.optimizer_offload,
        "{asked} needs ZeRO stage {stages} (the offloaded optimizer steps a partition; this is "
        'stage {stage}); set zero_optimization.stage or set offload_optimizer.device to "none"',
        at_config=True,
    ),
    Rule(
        "partial_offload",
        _partial_offload,
        _C.partial_offload,
        "{asked} (partial offload) needs ZeRO stage {stages}, as in DeepSpeed (this is stage "
        "{stage}); set zero_optimization.stage to {stages} or the ratio to 1.0",
        at_config=True,
    ),
    Rule(
        "low_precision_masters",
        _low_precision_masters,
        _C.low_precision_masters,
        "{asked} is only supported with ZeRO stage {stages} (zero_optimization.stage is {stage}).",
        at_config=True,
    ),
    Rule(
        "zeropp_quantization",
        _zeropp_quantization,
        _C.quantized_collectives,
        "zero_optimization.{asked}=true (ZeRO++ quantization) quantizes the collectives of "
        "sharded parameters, which needs ZeRO stage {stages} (got stage {stage}); set "
        "zero_optimization.stage to {stages} or remove the key",
        at_config=True,
    ),
    Rule(
        "zeropp_hpz",
        lambda setup: (
            "zero_optimization.zero_hpz_partition_size > 1"
            if setup.config.zero_optimization.zero_hpz_partition_size > 1
            else None
        ),
        _C.hpz,
        "{asked} (ZeRO++ hierarchical partitioning) keeps a secondary shard of the sharded "
        "parameters, which needs ZeRO stage {stages} (got stage {stage}); set "
        "zero_optimization.stage to {stages} or zero_hpz_partition_size to 1",
        at_config=True,
    ),
    Rule(
        "mics",
        lambda setup: (
            "zero_optimization.mics_shard_size (MiCS)"
            if setup.config.zero_optimization.mics_shard_size > 0
            else None
        ),
        _C.mics,
        "{asked} shards parameters, which needs ZeRO stage {stages} (got stage {stage}); set "
        "stage {stages} or remove mics_shard_size",
    ),
    Rule(
        "pipeline",
        lambda setup: "pipeline parallelism" if setup.pipeline else None,
        _C.pipeline,
        "ZeRO-2 and ZeRO-3 are incompatible with {asked} (zero_optimization.stage={stage}); "
        "use stage {stages} with a PipelineModule",
    ),
)


def check_config_rules(config: RootConfig) -> None:
    """Apply the rules DeepSpeed applies when it parses a config (``at_config``)."""
    setup = Setup(config)
    for rule in RULES:
        if rule.at_config:
            rule.check(setup)


def check_rules(config: RootConfig, *, pipeline: bool = False) -> None:
    """Apply every rule to ``config`` (``pipeline``: the model is a ``PipelineModule``)."""
    setup = Setup(config, pipeline=pipeline)
    for rule in RULES:
        rule.check(setup)
