"""DeepSpeed's ``deepspeed.compression.basic_layer`` names, re-exported from where they live."""

from shardspeed.compression.conv import Conv2dLayer_Compress
from shardspeed.compression.layers import Embedding_Compress, LinearLayer_Compress

__all__ = ["Conv2dLayer_Compress", "Embedding_Compress", "LinearLayer_Compress"]
