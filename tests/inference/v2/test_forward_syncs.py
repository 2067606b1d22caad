"""The ragged forward never waits on the device: what it needs to know on the host (each
sequence's new-token count, the largest position, the last rows) comes with the batch metadata,
built on the host. On a GPU a device-to-host read in the forward would stall the host until the
queued kernels finish, and could not be captured in a CUDA graph."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from tests.inference.v2 import hf_models as hm
from tests.inference.v2.test_engine_v2 import make_engine

# ops that read a device value on the host (or size their output by one)
_SYNCING = {"_local_scalar_dense", "bincount", "nonzero", "masked_select", "unique_consecutive"}


class _Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _SYNCING or (
            name == "repeat_interleave" and "output_size" not in (kwargs or {})
        ):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gpt2"])
def test_forward_reads_nothing_back(family: str) -> None:
    engine = make_engine(hm.build(family))
    forward = engine.model.forward
    reads = _Reads()

    def watched(*args: Any, **kwargs: Any) -> Any:
        with reads:
            return forward(*args, **kwargs)

    engine.model.forward = watched  # type: ignore[method-assign]
    long = hm.tokens(30, 1)
    # fresh prompts; then a continued chunk beside decode tokens and a new prompt; then decodes
    engine.put([1, 2], [long[:20], hm.tokens(5, 2)])
    engine.put([1, 2, 3], [long[20:], hm.tokens(1, 3), hm.tokens(7, 4)])
    logits = engine.put([1, 2, 3], [hm.tokens(1, 5), hm.tokens(1, 6), hm.tokens(1, 7)])
    assert logits.shape[0] == 3
    assert reads.found == []
