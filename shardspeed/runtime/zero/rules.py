"""What ``initialize`` refuses about a ZeRO config: every rule of the table
(:mod:`shardspeed.config.zero_rules`, which also runs when the config is parsed) and an NVMe
offload folder this rank cannot use."""

from __future__ import annotations

from shardspeed.config.root import RootConfig
from shardspeed.config.zero_rules import RULES, Rule, check_rules
from shardspeed.runtime.zero.offload import check_offload_folders

__all__ = ["RULES", "Rule", "check_zero_config"]


def check_zero_config(config: RootConfig, *, pipeline: bool = False) -> None:
    """Refuse what the configured ZeRO stage cannot do (``pipeline``: the model is a
    ``PipelineModule``) and an NVMe offload folder that is missing or not writable."""
    check_rules(config, pipeline=pipeline)
    check_offload_folders(config.zero_optimization)
