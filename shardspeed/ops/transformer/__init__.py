"""DeepSpeed's BERT-style transformer layer (``deepspeed.ops.transformer``) in plain PyTorch:
:class:`DeepSpeedTransformerConfig` and :class:`DeepSpeedTransformerLayer`."""

from shardspeed.ops.transformer.transformer import (
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
    TransformerConfig,
)

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "TransformerConfig"]
