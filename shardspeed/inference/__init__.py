"""Inference: ``init_inference``, the ``InferenceEngine``, AutoTP, int8 weights, fused decoding.

Submodules are imported where used (``shardspeed.inference.engine``, ``.config``, ...), so
importing the package costs nothing.
"""
