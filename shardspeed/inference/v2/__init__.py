"""Inference v2 (DeepSpeed's FastGen): ragged batching over a blocked KV cache.

Only the foundation lives here so far: ``ragged/`` holds the block allocator, the blocked KV
cache with per-sequence block tables and paged attention in plain PyTorch.
"""
