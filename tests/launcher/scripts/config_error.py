"""Every rank joins the process group, then builds a DeepSpeed config with a misspelt key (the
error every rank raises at once); ``--ok`` ranks print a handled traceback and succeed."""

from __future__ import annotations

import sys
import traceback

from shardspeed import comm
from shardspeed.config import DeepSpeedConfig

comm.init_distributed(dist_backend="gloo")
comm.barrier()
print(f"rank {comm.get_rank()} is up", flush=True)
if "--ok" in sys.argv:
    try:
        raise KeyError("handled")
    except KeyError:
        traceback.print_exc()
    sys.exit(0)
DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimisation": {"stage": 2}})
