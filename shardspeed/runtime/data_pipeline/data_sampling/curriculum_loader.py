"""The training loader of ``data_efficiency`` curriculum learning: its batches come from a
:class:`~shardspeed.runtime.data_pipeline.data_sampling.data_sampler.DeepSpeedDataSampler`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from shardspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from shardspeed.runtime.dataloader import DeepSpeedDataLoader

__all__ = ["CurriculumDataLoader", "build_curriculum_loader"]


class CurriculumDataLoader(DeepSpeedDataLoader):
    """Micro-batches drawn by the curriculum sampler (``data_sampler``), passed through the
    engine's ``set_data_post_process_func`` function (``fn(batch, sampler_state)``) if set."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: DeepSpeedDataSampler,
        collate_fn: Callable[..., Any] | None,
        num_workers: int,
        pin_memory: bool,
    ) -> None:
        # not DeepSpeedDataLoader.__init__: the sampler here is a batch sampler of its own
        self.tput_timer = None
        self.batch_size = sampler.micro_batch_size
        self.owns_sampler = False
        self.data_sampler: Any = sampler
        self.dataloader = DataLoader(
            dataset,
            batch_sampler=sampler,  # type: ignore[arg-type]  # yields lists of indices
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory and torch.cuda.is_available(),
        )
        self.epoch = 0
        self._iter = None
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None

    def __len__(self) -> int:
        sampler = self.data_sampler
        return sampler.total_samples // sampler.micro_batch_times_data_parallel_size

    def __next__(self) -> Any:
        batch = super().__next__()
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, self.data_sampler.state_dict())
        return batch


def build_curriculum_loader(
    dataset: Dataset,
    config: Any,
    dp_world_size: int,
    dp_rank: int,
    batch_size: int,
    collate_fn: Callable[..., Any] | None,
) -> CurriculumDataLoader:
    """The curriculum loader of ``dataset`` for ``config`` (a DeepSpeedConfig)."""
    section = config.data_efficiency
    sampler = DeepSpeedDataSampler(
        section,
        one_epoch_total_samples=len(dataset),  # type: ignore[arg-type]  # map-style
        micro_batch_size=batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_world_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        drop_last=bool(config.dataloader_drop_last),
    )
    sampling = section.data_sampling
    return CurriculumDataLoader(
        dataset, sampler, collate_fn, sampling.num_workers, sampling.pin_memory
    )
