"""``deepspeed`` answered by shardspeed: the opt-in compatibility package.

This replaces a DeepSpeed install. ``deepspeed.X.Y`` is the module ``shardspeed.X.Y`` itself;
nothing of shardspeed is copied here. Uninstall with ``pip uninstall deepspeed``.
"""

from shardspeed.compat.deepspeed_shim import attach

__shardspeed_compat__ = True

attach(globals())
del attach
