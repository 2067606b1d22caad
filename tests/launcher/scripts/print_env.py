"""Writes this rank's launcher variables and argv as JSON to ``<out_dir>/<RANK>.json`` (no torch).

With ``--exit_code N --exit_rank R`` rank R exits with code N right away; with ``--hang`` every
other rank then waits, so tests can check that a failure tears the rest down.
"""

from __future__ import annotations

import json
import os
import sys
import time

VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "SHARDSPEED_TEST_MARKER",
)


def main(argv: list[str]) -> int:
    out_dir = next(a for a in argv if not a.startswith("--local_rank="))
    rank = os.environ.get("RANK", "x")
    record = {name: os.environ.get(name) for name in VARS}
    record["argv"] = argv
    record["pid"] = os.getpid()
    record["affinity"] = sorted(os.sched_getaffinity(0))
    # Write then rename, so a test polling the directory never reads a half-written record.
    final = os.path.join(out_dir, f"{rank}.json")
    with open(final + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(final + ".tmp", final)
    print(f"hello from rank {rank}", flush=True)
    if "--exit_rank" in argv and argv[argv.index("--exit_rank") + 1] == rank:
        return int(argv[argv.index("--exit_code") + 1])
    if "--hang" in argv:
        time.sleep(60)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
