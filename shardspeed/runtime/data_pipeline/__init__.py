"""Data efficiency (DeepSpeed's ``deepspeed.runtime.data_pipeline``): curriculum learning
(schedules, the curriculum sampler, the data analyzer) and random-LTD token dropping."""

from shardspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from shardspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from shardspeed.runtime.data_pipeline.data_routing.helper import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
)
from shardspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

__all__ = [
    "CurriculumScheduler",
    "RandomLTDScheduler",
    "RandomLayerTokenDrop",
    "convert_to_random_ltd",
    "remove_random_ltd_state_dict",
]
