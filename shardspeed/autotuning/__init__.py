"""Autotuning: ``shardspeed --autotuning tune|run`` searches ZeRO stage, micro-batch size (for a
fixed global batch), offload and bucket sizes, the tensor x sequence-parallel layout and activation
checkpointing for the fastest configuration that fits in memory.

Modules, one concept each: :mod:`.space` (the search space from the user's config),
:mod:`.fit` (memory pruning), :mod:`.experiment` (one launch), :mod:`.tuner` (grid, random,
model-based), :mod:`.autotuner` (DeepSpeed's ``Autotuner``), :mod:`.report` (table and plot).
The engine side is ``shardspeed.runtime.autotuning_probe``: the runtime only measures and writes
the metric file an experiment's config names, and imports nothing from here. Nothing here
imports torch.
"""
