"""Capturing a step into a device graph, PyTorch's recipe for ``torch.cuda.graph``: a few eager
runs on a side stream first (so that lazily made library handles and workspaces exist before
the graph records), then the capture; shared by v1's fixed-shape decoding step and inference
v2's bucketed decode batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from shardspeed.accelerator import get_accelerator

__all__ = ["capture_step"]

# eager runs before a capture: each repeats the step (its cache writes rewrite equal values)
WARMUP_RUNS = 3


def capture_step(
    step: Callable[[], torch.Tensor],
    pool: Any = None,
    warmups: int = WARMUP_RUNS,
    recording: contextlib.AbstractContextManager[Any] | None = None,
) -> tuple[Any, torch.Tensor]:
    """Run ``step`` ``warmups`` times on a side stream, then capture it; returns the graph and
    the step's output tensor (which each replay rewrites). ``pool``: a memory pool to share
    with earlier graphs; ``recording``: a context held around the capture alone."""
    accelerator = get_accelerator()
    graph = accelerator.create_graph()
    if graph is None:
        raise RuntimeError(
            f"enable_cuda_graph: the {accelerator.device_name()} accelerator cannot capture "
            "graphs; set enable_cuda_graph=False."
        )
    side = accelerator.Stream()
    side.wait_stream(accelerator.current_stream())
    with accelerator.stream(side):
        for _ in range(warmups):
            step()
    accelerator.current_stream().wait_stream(side)
    with recording or contextlib.nullcontext(), accelerator.capture_to_graph(graph, pool=pool):
        output = step()
    return graph, output
