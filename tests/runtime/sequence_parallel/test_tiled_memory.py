"""The tiled loss's peak memory is lower than the untiled loss's at a long sequence.

Each variant runs in a fresh process and reports how far its resident set size peaked above
where it stood before the loss (Linux's ``VmHWM``, reset to the current size through
``/proc/self/clear_refs`` first): works for CPU tensors, no allocator hooks needed. Not
``ru_maxrss``: a child inherits its parent's peak across exec, so a test process grown large
would hide the loss's own peak.
The untiled loss holds the ``[tokens, vocab]`` logits, their log-softmax and their gradient at
once (256 MiB each here); the tiled one holds a sixteenth of each at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import torch
import torch.nn.functional as F
from shardspeed.runtime.sequence_parallel.tiled_compute import TiledFusedLogitsLoss

torch.manual_seed(0)
torch.set_num_threads(1)
seq, hidden, vocab = 8192, 64, 8192
head = torch.nn.Linear(hidden, vocab, bias=False)
x = torch.randn(1, seq, hidden, requires_grad=True)
y = torch.randint(0, vocab, (1, seq))

def loss_fn(self, h, t):
    return F.cross_entropy(self(h).view(-1, vocab), t.view(-1))

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])  # KiB

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak so far := the size now
except OSError as exc:  # a sandbox may forbid it
    print(json.dumps({"skip": f"cannot reset the peak RSS: {exc}"}))
    sys.exit(0)
before = status("VmRSS")
if sys.argv[1] == "tiled":
    loss = TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 16, None, "mean")
else:
    loss = loss_fn(head, x, y)
loss.backward()
peak = status("VmHWM")
print(json.dumps({"loss": loss.item(), "before_kib": before, "peak_kib": peak}))
"""


def run_variant(variant: str) -> dict[str, float]:
    # a fixed mmap threshold: glibc otherwise raises it as big blocks are freed and keeps the
    # freed tiles' buffers in its heap, so the peak would count the allocator's cache
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, variant],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc/self/status")
def test_tiled_loss_peak_memory_is_lower_than_untiled():
    untiled, tiled = run_variant("untiled"), run_variant("tiled")
    if "skip" in untiled:
        pytest.skip(untiled["skip"])
    assert abs(untiled["loss"] - tiled["loss"]) < 1e-5 * abs(untiled["loss"])
    grown_untiled = untiled["peak_kib"] - untiled["before_kib"]
    grown_tiled = tiled["peak_kib"] - tiled["before_kib"]
    # the logits alone are 256 MiB; the tiled loss grows by a fraction of that
    assert grown_untiled > 256 * 1024
    assert grown_tiled < grown_untiled / 4, (grown_tiled, grown_untiled)
