"""DeepSpeed's ``deepspeed.compression.helper`` names, re-exported from where they live."""

from shardspeed.compression.compress import compression_preparation
from shardspeed.compression.replace import (
    convert_conv1d_to_linear,
    is_module_compressible,
    recursive_getattr,
    recursive_setattr,
)

__all__ = [
    "compression_preparation",
    "convert_conv1d_to_linear",
    "is_module_compressible",
    "recursive_getattr",
    "recursive_setattr",
]
