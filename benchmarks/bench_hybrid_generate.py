"""The hybrid engine's generation under ZeRO-3 vs generating through the training engine's hooks.

    python benchmarks/bench_hybrid_generate.py          # 2 CPU ranks (gloo), 64 new tokens

One Llama built from a config (``--hidden``, ``--layers``, vocab 512) is wrapped at ZeRO stage 3
with ``hybrid_engine.enabled``; each rank generates ``--new-tokens`` greedy tokens for its own 2
prompts, once with ``engine.generate`` (the parameters gathered once per call, shardspeed's fused
decoder) and once with ``engine.module.generate`` (Hugging Face's loop, the ZeRO-3 hooks gathering
and releasing every module at every token), best of ``--repeats`` each. Both produce the same
tokens (checked). Prints one JSON line: seconds per call on rank 0, and the speed-up.

It is the benchmark companion of tests/runtime/hybrid_engine (``timing_case`` runs on each rank).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness.distributed import DistributedPool  # noqa: E402
from tests.runtime.hybrid_engine.ranks import timing_case  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    pool = DistributedPool(args.world)
    try:
        ranks = pool.run(
            timing_case, args.new_tokens, args.hidden, args.layers, args.repeats, timeout_s=600
        )
    finally:
        pool.close()
    first = ranks[0]
    print(
        json.dumps(
            {
                "bench": "hybrid_generate",
                "world": args.world,
                "new_tokens": args.new_tokens,
                "params": first["params"],
                "hybrid_s": round(first["hybrid"], 4),
                "zero3_hooks_s": round(first["hooks"], 4),
                "speedup": round(first["hooks"] / first["hybrid"], 2),
                "same_tokens": all(r["equal"] for r in ranks),
            }
        )
    )


if __name__ == "__main__":
    main()
