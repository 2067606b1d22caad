"""``zero.MiCS_Init``: ``zero.Init`` partitioning over MiCS shard groups.

Parameters are split over this rank's shard group of ``zero_optimization.mics_shard_size`` ranks
as the module is built (so each rank holds ``1/mics_shard_size`` of the model from the start);
``initialize`` with the same config then trains them under MiCS.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.runtime.zero.init_context import Init, _config_dict
from shardspeed.runtime.zero.mics import mics_process_group


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's name
    """``zero.Init`` whose partitions are MiCS shard groups (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        sequence_data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
    ) -> None:
        group = None
        if enabled:
            settings = _config_dict(config_dict_or_path, config)
            zero = settings.get("zero_optimization") or {}
            size = int(zero.get("mics_shard_size", -1))
            if size < 1:
                raise ValueError(
                    "zero.MiCS_Init needs zero_optimization.mics_shard_size > 0 in its config "
                    "(config_dict_or_path=...); pass the DeepSpeed config the engine will use"
                )
            wide = data_parallel_group
            if wide is not None and wide is not comm.get_world_group():
                raise NotImplementedError(
                    "zero.MiCS_Init takes the data-parallel axis from the mpu (mpu=...) or the "
                    "job's topology, not from a bare data_parallel_group; pass mpu= instead"
                )
            group = mics_process_group(size, mpu)
        super().__init__(
            module=module,
            data_parallel_group=group,
            mem_efficient_linear=mem_efficient_linear,
            remote_device=remote_device,
            pin_memory=pin_memory,
            config_dict_or_path=config_dict_or_path,
            config=config,
            enabled=enabled,
            dtype=dtype,
            sequence_data_parallel_group=sequence_data_parallel_group,
        )
