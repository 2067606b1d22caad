"""The ``*Builder`` classes under DeepSpeed's names, one per op.

The optimizers and ``AsyncIOBuilder`` are implemented in pure Python (``load()`` returns the
module); the rest are DeepSpeed native extensions shardspeed does not have (``is_compatible()``
is False).
"""

from __future__ import annotations

from shardspeed.ops.op_builder.builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    IMPLEMENTATION = "shardspeed.ops.adam.cpu_adam"


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    IMPLEMENTATION = "shardspeed.ops.adam.fused_adam"


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    IMPLEMENTATION = "shardspeed.ops.adagrad.cpu_adagrad"


class FusedLambBuilder(OpBuilder):
    NAME = "fused_lamb"
    IMPLEMENTATION = "shardspeed.ops.lamb.fused_lamb"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    IMPLEMENTATION = "shardspeed.ops.lion.lion"


class FusedLionBuilder(OpBuilder):
    NAME = "fused_lion"
    IMPLEMENTATION = "shardspeed.ops.lion.lion"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    IMPLEMENTATION = "shardspeed.ops.aio"


class EvoformerAttnBuilder(OpBuilder):
    NAME = "evoformer_attn"


class QuantizerBuilder(OpBuilder):
    NAME = "quantizer"


class RandomLTDBuilder(OpBuilder):
    NAME = "random_ltd"


class SparseAttnBuilder(OpBuilder):
    NAME = "sparse_attn"


class SpatialInferenceBuilder(OpBuilder):
    NAME = "spatial_inference"


class TransformerBuilder(OpBuilder):
    NAME = "transformer"


class StochasticTransformerBuilder(OpBuilder):
    NAME = "stochastic_transformer"


class InferenceBuilder(OpBuilder):
    NAME = "transformer_inference"


class InferenceCoreBuilder(OpBuilder):
    NAME = "inference_core_ops"


BUILDERS: tuple[type[OpBuilder], ...] = (
    CPUAdamBuilder,
    FusedAdamBuilder,
    CPUAdagradBuilder,
    FusedLambBuilder,
    CPULionBuilder,
    FusedLionBuilder,
    AsyncIOBuilder,
    EvoformerAttnBuilder,
    QuantizerBuilder,
    RandomLTDBuilder,
    SparseAttnBuilder,
    SpatialInferenceBuilder,
    TransformerBuilder,
    StochasticTransformerBuilder,
    InferenceBuilder,
    InferenceCoreBuilder,
)
