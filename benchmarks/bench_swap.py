"""NVMe swapper bandwidth: :class:`shardspeed.runtime.swap.TensorSwapper` against ``dd``.

    python benchmarks/bench_swap.py                              # a temp dir under the cwd
    python benchmarks/bench_swap.py --folder /local_nvme --size-mb 1024 --repeats 5

The same sweep as the ``shardspeed-io`` command (DeepSpeed's ``ds_io`` / ``ds_nvme_tune``): on
one folder, in one run, round by round, ``dd`` overwrites a file in place with
``oflag=direct conv=notrunc`` and reads it with ``iflag=direct`` at each block size, and the
swapper overwrites and reads one ``--size-mb`` tensor (aligned buffer, ``O_DIRECT`` where the
filesystem accepts it) at each block size x queue depth x thread count. Each figure is the
median over ``--repeats`` rounds with its min and max. ``best`` compares the swapper at the
single ``aio`` setting with the highest write+read median (``best_aio``, ready to paste into a
config) against ``dd``'s best block size; ``per_block_size`` compares, at each block size, ``dd``
with the swapper's best queue depth and thread count. Prints one JSON line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from shardspeed.runtime.swap.io_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
