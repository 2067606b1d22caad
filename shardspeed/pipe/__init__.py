"""``shardspeed.pipe``: DeepSpeed's public pipeline names (``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``, the topologies); they live in :mod:`shardspeed.runtime.pipe`."""

from shardspeed.runtime.pipe import *  # noqa: F403 - the facade re-exports exactly that list
from shardspeed.runtime.pipe import __all__ as __all__
