"""Pipeline parallelism. So far only the process grid (:mod:`.topology`); the pipeline engine,
schedules and ``PipelineModule`` are not implemented yet (a config asking for pipeline stages
fails at initialize)."""

from shardspeed.runtime.pipe.topology import ProcessTopology

__all__ = ["ProcessTopology"]
