"""The ZeRO options a strategy reads, typed and resolved once from the config.

:func:`zero_options` turns the validated ``zero_optimization`` and ``aio`` sections into one
frozen :class:`ZeroOptions`; assembly hands it to the strategy in its
:class:`~shardspeed.runtime.zero.strategy.StrategyContext`, and the strategies, their offload
placement and stage 3's sharding read its fields, never the config. The defaults are DeepSpeed's,
as the pydantic models state them: :meth:`ZeroOptions.defaults` resolves an empty section, so a
strategy built without a config (tests, tools) sees exactly what an empty config gives.

What a stage cannot do is not checked here: :mod:`shardspeed.config.zero_rules` holds every
refusal. ``stage3_gather_16bit_weights_on_model_save`` is not an option here either: as in
DeepSpeed, ``save_16bit_model`` reads it from the config when it saves (the engine's
``zero_gather_16bit_weights_on_model_save()``), so a config changed after ``initialize`` counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.config.aio import AioConfig
from shardspeed.config.zero import DeepSpeedZeroConfig, DeepSpeedZeroLeafModuleConfig
from shardspeed.runtime.zero.offload import OptimizerOffload, ParamOffload
from shardspeed.runtime.zero.param_sharding import ShardingOptions

__all__ = ["LeafModules", "ZeroOptions", "zero_options"]


@dataclass(frozen=True)
class LeafModules:
    """``zero_optimization.leaf_module``: the modules stage 3 gathers as a whole."""

    #: class names, fully qualified or bare
    classes: tuple[str, ...]
    #: dotted module names, as ``named_modules()`` gives them
    names: tuple[str, ...]
    #: module-name suffixes
    name_suffixes: tuple[str, ...]

    @classmethod
    def from_section(cls, section: DeepSpeedZeroLeafModuleConfig) -> LeafModules:
        return cls(
            classes=tuple(section.classes),
            names=tuple(section.names),
            name_suffixes=tuple(section.name_suffixes),
        )


@dataclass(frozen=True)
class ZeroOptions:
    """Every ``zero_optimization`` setting a strategy acts on (see the module docstring)."""

    #: ``stage``: 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters partitioned
    stage: int
    #: ``ignore_unused_parameters``: a trained parameter with no gradient is not an error
    ignore_unused_parameters: bool
    #: ``sub_group_size``: elements the optimizer steps at a time (0: all at once)
    sub_group_size: int
    #: ``leaf_module``
    leaf_modules: LeafModules
    #: the ``stage3_*`` knobs that decide what stays gathered
    sharding: ShardingOptions
    #: ``offload_optimizer``: where the masters and optimizer state live
    offload_optimizer: OptimizerOffload
    #: ``offload_param``: where stage 3's parameter shards live between uses
    offload_param: ParamOffload
    #: ``mics_shard_size``: ranks a parameter is sharded over (-1: the data-parallel group)
    mics_shard_size: int
    #: the ``aio`` section: how NVMe offload reads and writes
    aio: AioConfig
    #: ``save_muon_momentum_buffer_in_memory``: NVMe optimizer offload swaps Muon's momentum
    #: buffer too unless this is set
    save_muon_momentum_buffer_in_memory: bool = False

    @classmethod
    def defaults(cls) -> ZeroOptions:
        """The options of an empty ``zero_optimization`` section (stage 0)."""
        return zero_options(DeepSpeedZeroConfig())


def zero_options(zero: DeepSpeedZeroConfig, aio: AioConfig | None = None) -> ZeroOptions:
    """The typed options of a validated ``zero_optimization`` section (and ``aio``)."""
    return ZeroOptions(
        stage=int(zero.stage),
        ignore_unused_parameters=bool(zero.ignore_unused_parameters),
        sub_group_size=int(zero.sub_group_size),
        leaf_modules=LeafModules.from_section(zero.leaf_module),
        sharding=ShardingOptions(
            param_persistence_threshold=int(zero.param_persistence_threshold),
            model_persistence_threshold=int(zero.model_persistence_threshold),
            max_live_parameters=int(zero.max_live_parameters),
            prefetch_bucket_size=int(zero.prefetch_bucket_size),
            max_reuse_distance=int(zero.max_reuse_distance),
        ),
        offload_optimizer=OptimizerOffload.from_section(zero.offload_optimizer),
        offload_param=ParamOffload.from_section(zero.offload_param),
        mics_shard_size=int(zero.mics_shard_size),
        aio=aio if aio is not None else AioConfig(),
        save_muon_momentum_buffer_in_memory=bool(zero.save_muon_momentum_buffer_in_memory),
    )
