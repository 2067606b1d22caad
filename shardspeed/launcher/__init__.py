"""The ``shardspeed`` launcher: hostfiles, resource selection, environment export and spawning.

Nothing here imports torch or any runtime module, so ``shardspeed --help`` starts in well under a
second. ``runner`` is the multi-node CLI, ``launch`` the per-node spawner.
"""
