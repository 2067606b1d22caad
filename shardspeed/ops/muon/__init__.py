"""Muon (MomentUm Orthogonalized by Newton-Schulz) with an auxiliary AdamW, at every ZeRO stage."""

from shardspeed.ops.muon.layout import MatrixSpan, ShardedMatrices
from shardspeed.ops.muon.muon_optimizer import MuonWithAuxAdam, check_muon_settings
from shardspeed.ops.muon.newton_schulz import adjusted_lr, orthogonalize
from shardspeed.ops.muon.tagging import MUON_OPTIMIZER, muon_param_groups, set_optimizer_flags

__all__ = [
    "MUON_OPTIMIZER",
    "MatrixSpan",
    "MuonWithAuxAdam",
    "ShardedMatrices",
    "adjusted_lr",
    "check_muon_settings",
    "muon_param_groups",
    "orthogonalize",
    "set_optimizer_flags",
]
