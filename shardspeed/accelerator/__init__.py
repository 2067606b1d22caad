"""Device abstraction: the only place shardspeed talks to ``torch.cuda`` / ``torch.mps``.

``get_accelerator()`` returns the process's backend (CUDA, MPS or CPU); see
:mod:`shardspeed.accelerator.real_accelerator` for how it is chosen.
"""

from shardspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from shardspeed.accelerator.cpu_accelerator import CPU_Accelerator
from shardspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from shardspeed.accelerator.host_streams import HostEvent, HostStream
from shardspeed.accelerator.mps_accelerator import MPS_Accelerator
from shardspeed.accelerator.real_accelerator import (
    SUPPORTED_ACCELERATOR_LIST,
    get_accelerator,
    is_current_accelerator_supported,
    select_accelerator,
    set_accelerator,
)

__all__ = [
    "CPU_Accelerator",
    "CUDA_Accelerator",
    "DeepSpeedAccelerator",
    "HostEvent",
    "HostStream",
    "MPS_Accelerator",
    "SUPPORTED_ACCELERATOR_LIST",
    "get_accelerator",
    "is_current_accelerator_supported",
    "select_accelerator",
    "set_accelerator",
]
