"""Activation checkpointing: recompute blocks in backward instead of keeping their activations.

Modules: ``state`` (settings from ``configure``), ``rng`` (RNG tracker and snapshots),
``partition`` (where saved inputs live), ``function`` (the autograd function) and
``checkpointing`` (DeepSpeed's public module, re-exported as ``shardspeed.checkpointing``).
"""
