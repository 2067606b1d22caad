"""AutoEP: automatic expert parallelism for Hugging Face MoE models (the ``expert_parallel``
config section). ``initialize`` calls :func:`apply_autoep` before building the ZeRO strategy."""

from shardspeed.moe.autoep.apply import apply_autoep
from shardspeed.moe.autoep.detection import MoEBlockSpec, detect_moe_blocks, resolve_preset
from shardspeed.moe.autoep.layer import AutoEPMoELayer
from shardspeed.moe.autoep.presets import PRESETS, MoEPreset

__all__ = [
    "PRESETS",
    "AutoEPMoELayer",
    "MoEBlockSpec",
    "MoEPreset",
    "apply_autoep",
    "detect_moe_blocks",
    "resolve_preset",
]
