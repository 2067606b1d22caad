"""``unwrap_model_for_generation``: the model of a (ZeRO-3) engine, ready to generate.

RLHF code (TRL's ``unwrap_model_for_generation``, OpenRLHF) generates with the model an engine
wraps. Under ZeRO-3 each rank holds shards, and generating through the engine's module runs the
strategy's hooks, which gather every module for every token. This context manager gathers the
whole model once (one all-gather per gather unit, all in flight together; nothing below stage
3) and yields a hook-free view of it sharing the gathered weights (the hybrid engine's
:func:`~shardspeed.runtime.hybrid_shadow.generation_view`), so ``model.generate(...)`` inside the
block runs no collective per token and cannot disturb the training engine's hooks or trace. The
view is in eval mode; the weights return to their shards when the block ends. With
``gather_deepspeed3_params=False`` the engine's own module is yielded and its hooks gather
module by module (for a model too large to be whole on one rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from shardspeed.runtime.hybrid_shadow import generation_view
from shardspeed.runtime.zero.partition_parameters import GatheredParameters

__all__ = ["unwrap_model_for_generation"]


@contextmanager
def unwrap_model_for_generation(
    model: Any, gather_deepspeed3_params: bool = True
) -> Iterator[nn.Module]:
    """Yield the model ``model`` (an engine or a module) wraps, gathered and hook-free for
    generation (module docstring); every rank of the data-parallel group must enter it."""
    module = getattr(model, "module", model)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"unwrap_model_for_generation needs an engine or a torch.nn.Module, got "
            f"{type(model).__name__}"
        )
    if not gather_deepspeed3_params:
        yield module
        return
    with GatheredParameters(list(module.parameters())):
        yield generation_view(module)
