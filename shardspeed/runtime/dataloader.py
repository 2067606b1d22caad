"""Data loading for data-parallel training: each rank reads its own shard of every epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from shardspeed.utils.loaders import RepeatingLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]


class _EpochTrackingSampler(DistributedSampler):  # type: ignore[type-arg]  # no item type
    """A ``DistributedSampler`` that notes whether the caller set its epoch."""

    epoch_set_by_caller = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_set_by_caller = True


class DeepSpeedDataLoader:
    """An iterator over micro-batches of this rank's shard (``DistributedSampler`` by default).

    Iterating it again starts a new epoch: the sampler it made itself gets the next epoch (a new
    shuffle) unless the caller set one since the last pass; a ``data_sampler`` passed in is
    left as the caller keeps it, as DeepSpeed does.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        pin_memory: bool,
        local_rank: int,
        tput_timer: Any = None,
        collate_fn: Callable[..., Any] | None = None,
        num_local_io_workers: int | None = None,
        data_sampler: Sampler | None = None,
        data_parallel_world_size: int | None = None,
        data_parallel_rank: int | None = None,
        dataloader_drop_last: bool = False,
        deepspeed_dataloader_config: dict[str, Any] | None = None,
    ) -> None:
        del local_rank, deepspeed_dataloader_config  # kept for DeepSpeed's signature
        self.tput_timer = tput_timer
        self.batch_size = batch_size
        world = data_parallel_world_size or 1
        rank = data_parallel_rank or 0
        #: the sampler is this loader's own, so its epochs are this loader's to advance
        self.owns_sampler = data_sampler is None
        if data_sampler is None:
            data_sampler = _EpochTrackingSampler(
                dataset, num_replicas=world, rank=rank, shuffle=True, drop_last=dataloader_drop_last
            )
        self.data_sampler = data_sampler
        self.dataloader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=data_sampler,
            collate_fn=collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and torch.cuda.is_available(),
            drop_last=dataloader_drop_last,
        )
        self.epoch = 0
        self._iter: Iterator[Any] | None = None

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> DeepSpeedDataLoader:
        sampler = self.data_sampler
        if isinstance(sampler, _EpochTrackingSampler) and self.owns_sampler:
            if self.epoch > 0 and not sampler.epoch_set_by_caller:
                sampler.epoch += 1
            sampler.epoch_set_by_caller = False
        self.epoch += 1
        self._iter = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self._iter is None:
            iter(self)
        assert self._iter is not None
        if self.tput_timer is not None:
            self.tput_timer.start()
        return next(self._iter)


def build_dataloader(
    dataset: Dataset,
    config: Any,
    dp_world_size: int,
    dp_rank: int,
    *,
    batch_size: int | None = None,
    pin_memory: bool = True,
    data_sampler: Sampler | None = None,
    collate_fn: Callable[..., Any] | None = None,
    num_local_io_workers: int | None = None,
) -> DeepSpeedDataLoader:
    """A loader of data-parallel rank ``dp_rank``'s shard of ``dataset`` in micro-batches of
    ``batch_size`` (default: the config's micro-batch)."""
    from shardspeed import comm  # the loader itself needs no communication

    efficiency = getattr(config, "data_efficiency", None)
    if data_sampler is None and efficiency is not None and efficiency.curriculum_enabled:
        # data_efficiency curriculum learning: batches within the scheduled difficulty
        from shardspeed.runtime.data_pipeline.data_sampling.curriculum_loader import (
            build_curriculum_loader,
        )

        size = batch_size or config.train_micro_batch_size_per_gpu
        return build_curriculum_loader(dataset, config, dp_world_size, dp_rank, size, collate_fn)
    return DeepSpeedDataLoader(
        dataset,
        batch_size=batch_size or config.train_micro_batch_size_per_gpu,
        pin_memory=pin_memory,
        local_rank=comm.get_local_rank(),
        collate_fn=collate_fn,
        num_local_io_workers=num_local_io_workers,
        data_sampler=data_sampler,
        data_parallel_world_size=dp_world_size,
        data_parallel_rank=dp_rank,
        dataloader_drop_last=bool(config.dataloader_drop_last),
    )
