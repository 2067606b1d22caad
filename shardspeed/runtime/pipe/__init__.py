"""Pipeline parallelism: the rank grid (:mod:`.topology`), ``PipelineModule`` and layer specs
(:mod:`.module`, :mod:`.layer_spec`), schedules as data (:mod:`.schedule`), the activation
exchange (:mod:`.p2p`) and the executor (:mod:`.engine`). The engine is imported on first use,
so importing the grid stays light."""

from shardspeed.runtime.pipe.layer_spec import LayerSpec, TiedLayerSpec
from shardspeed.runtime.pipe.module import PipelineError, PipelineModule
from shardspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineError",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
]
