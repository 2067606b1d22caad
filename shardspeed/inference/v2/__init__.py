"""Inference v2 (DeepSpeed's FastGen): ragged batching over a blocked KV cache.

``ragged/`` holds the block allocator, the blocked KV cache, paged attention and the state
manager (sequence tracking, prefix sharing); ``model/`` the pure ragged forward of the supported
Hugging Face families; :class:`InferenceEngineV2` puts ragged batches through them and
:func:`build_hf_engine` builds one from a Hugging Face model or its local path (or from a
folder :meth:`InferenceEngineV2.serialize` wrote, as :func:`build_engine_from_ds_checkpoint`).
"""

from shardspeed.inference.v2.config_v2 import RaggedInferenceEngineConfig
from shardspeed.inference.v2.engine_factory import build_engine_from_ds_checkpoint, build_hf_engine
from shardspeed.inference.v2.engine_v2 import InferenceEngineV2
from shardspeed.inference.v2.scheduling_utils import SchedulingError, SchedulingResult

__all__ = [
    "InferenceEngineV2",
    "RaggedInferenceEngineConfig",
    "SchedulingError",
    "SchedulingResult",
    "build_engine_from_ds_checkpoint",
    "build_hf_engine",
]
