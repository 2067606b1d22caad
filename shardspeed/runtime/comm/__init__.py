"""Communication schemes built on :mod:`shardspeed.comm` (DeepSpeed's ``runtime.comm``)."""
