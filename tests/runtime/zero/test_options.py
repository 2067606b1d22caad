"""``ZeroOptions``: the ``zero_optimization`` (and ``aio``) settings resolved once, typed, with
DeepSpeed's defaults; and the strategies reading them (one process, no collectives)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardspeed.config import AioConfig, DeepSpeedConfig
from shardspeed.config.zero import DEFAULT_LEAF_MODULE_CLASSES
from shardspeed.runtime.precision.policy import PrecisionPolicy
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.offload import OptimizerOffload, ParamOffload
from shardspeed.runtime.zero.options import LeafModules, ZeroOptions, zero_options
from shardspeed.runtime.zero.param_sharding import ShardingOptions
from shardspeed.runtime.zero.reduce_options import GradReduceOptions
from shardspeed.runtime.zero.registry import STRATEGIES
from shardspeed.runtime.zero.strategy import StrategyContext
from shardspeed.utils import z3_leaf_module


def _resolved(zero: dict[str, Any], aio: dict[str, Any] | None = None) -> ZeroOptions:
    config = DeepSpeedConfig(
        {"train_batch_size": 1, "zero_optimization": zero, **({"aio": aio} if aio else {})}
    )
    return zero_options(config.zero_optimization, config.aio)


def _every_key(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A section setting every key ZeroOptions reads to a value other than its default."""
    zero = {
        "stage": 3,
        "ignore_unused_parameters": False,
        "sub_group_size": 1234,
        "leaf_module": {"classes": ["Block"], "names": ["layers.0"], "name_suffixes": ["mlp"]},
        "stage3_param_persistence_threshold": 11,
        "stage3_model_persistence_threshold": 12,
        "stage3_max_live_parameters": 13,
        "stage3_prefetch_bucket_size": 14,
        "stage3_max_reuse_distance": 15,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5},
        "offload_param": {"device": "nvme", "nvme_path": str(folder), "pin_memory": True},
        "mics_shard_size": 2,
        "save_muon_momentum_buffer_in_memory": True,
    }
    aio = {"block_size": 4096, "queue_depth": 2, "intra_op_parallelism": 3}
    return zero, aio


def test_defaults_are_deepspeeds() -> None:
    defaults = ZeroOptions.defaults()
    assert defaults == _resolved({})
    assert defaults.stage == 0
    assert defaults.ignore_unused_parameters is True
    assert defaults.sub_group_size == 1_000_000_000
    assert defaults.leaf_modules == LeafModules(tuple(DEFAULT_LEAF_MODULE_CLASSES), (), ())
    # the stage-3 knobs' own defaults agree with the config's
    assert defaults.sharding == ShardingOptions()
    assert defaults.offload_optimizer == OptimizerOffload()
    assert defaults.offload_param == ParamOffload()
    assert not defaults.offload_optimizer.enabled and not defaults.offload_param.enabled
    assert defaults.mics_shard_size == -1
    assert defaults.aio == AioConfig()
    # a strategy built without a config sees exactly an empty config's options
    context = StrategyContext(
        precision=PrecisionPolicy(),
        reduce=GradReduceOptions(),
        data_parallel=CommGroup(None, 0, 1),
        device=torch.device("cpu"),
    )
    assert context.options == defaults


def test_every_field_is_read_from_the_config(tmp_path: Path) -> None:
    zero, aio = _every_key(tmp_path)
    options = _resolved(zero, aio)
    defaults = ZeroOptions.defaults()
    for field in dataclasses.fields(ZeroOptions):  # each field follows its key
        assert getattr(options, field.name) != getattr(defaults, field.name), field.name
    for field in dataclasses.fields(ShardingOptions):
        assert getattr(options.sharding, field.name) != getattr(defaults.sharding, field.name)
    assert options == ZeroOptions(
        stage=3,
        ignore_unused_parameters=False,
        sub_group_size=1234,
        leaf_modules=LeafModules(("Block",), ("layers.0",), ("mlp",)),
        sharding=ShardingOptions(11, 12, 13, 14, 15),
        offload_optimizer=OptimizerOffload(device="cpu", pin_memory=True, ratio=0.5),
        offload_param=ParamOffload(device="nvme", nvme_path=tmp_path, pin_memory=True),
        mics_shard_size=2,
        aio=AioConfig(block_size=4096, queue_depth=2, intra_op_parallelism=3),
        save_muon_momentum_buffer_in_memory=True,
    )
    assert isinstance(options.offload_param.device, str) and options.offload_param.to_nvme
    with pytest.raises(dataclasses.FrozenInstanceError):  # no strategy changes another's
        options.stage = 1  # type: ignore[misc]


def test_auto_values_resolve_to_the_defaults() -> None:
    auto = {
        key: "auto"
        for key in (
            "reduce_bucket_size",
            "sub_group_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        )
    }
    options = _resolved({"stage": 3, **auto})
    assert options == dataclasses.replace(ZeroOptions.defaults(), stage=3)


def test_the_strategies_act_on_the_typed_options() -> None:
    options = dataclasses.replace(
        ZeroOptions.defaults(),
        stage=3,
        ignore_unused_parameters=False,
        sub_group_size=7,
        leaf_modules=LeafModules((), ("0",), ()),
        sharding=ShardingOptions(param_persistence_threshold=3, max_reuse_distance=0),
    )
    context = StrategyContext(
        precision=PrecisionPolicy(),
        reduce=GradReduceOptions(bucket_size=100),
        data_parallel=CommGroup(None, 0, 1),
        device=torch.device("cpu"),
        options=options,
    )
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 1))
    strategy = STRATEGIES[3](model, context)
    strategy.place_module()
    strategy.bind_optimizer(torch.optim.AdamW(model.parameters()))
    assert strategy.stepper.size == 7
    assert strategy.group_options().ignore_unused_parameters is False
    assert strategy.sharding.options is options.sharding  # type: ignore[attr-defined]
    assert z3_leaf_module(model[0]) and not z3_leaf_module(model[1])
    assert strategy.offload is options.offload_optimizer
    assert strategy.param_offload is options.offload_param
    # stage3_gather_16bit_weights_on_model_save is the engine's to read at save time
    assert strategy.weights_for_save() is None
    assert strategy.weights_for_save(gather_partitioned=True) is not None
    strategy.destroy()
