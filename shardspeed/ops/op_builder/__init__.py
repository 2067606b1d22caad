"""DeepSpeed's ``deepspeed.ops.op_builder``: op builders for a package with no native code.

``CPUAdamBuilder().load()`` returns the shardspeed module implementing the op;
``is_compatible()`` is True exactly for the ops shardspeed implements. See :mod:`.builder`.
"""

from shardspeed.ops.op_builder.all_ops import ALL_OPS
from shardspeed.ops.op_builder.builder import OpBuilder, OpNotImplementedError
from shardspeed.ops.op_builder.builders import (
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    EvoformerAttnBuilder,
    FusedAdamBuilder,
    FusedLambBuilder,
    FusedLionBuilder,
    InferenceBuilder,
    InferenceCoreBuilder,
    QuantizerBuilder,
    RandomLTDBuilder,
    SparseAttnBuilder,
    SpatialInferenceBuilder,
    StochasticTransformerBuilder,
    TransformerBuilder,
)

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "EvoformerAttnBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "InferenceBuilder",
    "InferenceCoreBuilder",
    "OpBuilder",
    "OpNotImplementedError",
    "QuantizerBuilder",
    "RandomLTDBuilder",
    "SparseAttnBuilder",
    "SpatialInferenceBuilder",
    "StochasticTransformerBuilder",
    "TransformerBuilder",
]
