"""fp16 support at DeepSpeed's path; the mechanisms live in ``shardspeed.runtime.precision``."""
