"""DeepSpeed's ``runtime.zero.offload_config``: the offload device and state-kind enums."""

from __future__ import annotations

from enum import Enum

from shardspeed.config.offload import OffloadDeviceEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadStateTypeEnum(str, Enum):
    """The kinds of training state ``engine.offload_states`` moves."""

    #: the optimizer's state (Adam's moments)
    optim_states = "optim_states"
    #: the fp32 master parameters the optimizer steps (when they are not the model's memory)
    hp_params = "hp_params"
    #: the model's own (low-precision, or stage 3's sharded) parameters
    lp_params = "lp_params"
    #: the reduced gradients waiting for the step
    lp_grads = "lp_grads"
    #: the gradient bucket buffers kept for reuse between backwards
    contiguous_grad_buffer = "contiguous_grad_buffer"
