"""``DeepSpeedDataSampler``: curriculum sampling, only samples within the current difficulty.

At each global batch the curriculum step advances and every metric's
:class:`~shardspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler` gives its
difficulty. When a difficulty changes, the samples that just became eligible (metric value
``<=`` the difficulty, or within the first ``difficulty`` percentiles, for every metric) and
were not eligible before form a new *cluster*. A global batch draws from the clusters in
proportion to their sizes, each cluster read in a shuffled order (reshuffled when used up), and
is cut into micro-batches; each data-parallel rank yields its slice of each.

Unlike DeepSpeed, which draws on rank 0, writes each cluster to ``data_cluster_path`` and
broadcasts every batch, every rank computes the same clusters and draws from the same seeded
generator, so ranks agree with no communication; the clusters live in memory and in the
checkpoint (:meth:`state_dict`), and ``data_cluster_path`` is not needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from shardspeed.config.data_efficiency import CurriculumMetricConfig, DataEfficiencyConfig
from shardspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from shardspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

__all__ = ["DeepSpeedDataSampler"]


class DeepSpeedDataSampler:
    """A batch sampler (yields lists of dataset indices, one micro-batch of this rank each)."""

    def __init__(
        self,
        data_efficiency_config: DataEfficiencyConfig | Mapping[str, Any],
        one_epoch_total_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_parallel_group: Any = None,
        gradient_accumulation_steps: int = 1,
        global_rank: int = 0,
        drop_last: bool = True,
    ) -> None:
        del data_parallel_group, global_rank  # every rank draws the same batches itself
        config = (
            data_efficiency_config
            if isinstance(data_efficiency_config, DataEfficiencyConfig)
            else DataEfficiencyConfig.from_dict(data_efficiency_config)
        )
        if one_epoch_total_samples <= 0 or micro_batch_size <= 0:
            raise ValueError(
                f"DeepSpeedDataSampler: no samples to draw (dataset of {one_epoch_total_samples}, "
                f"micro-batch {micro_batch_size})"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} outside [0, {data_parallel_size})"
            )
        self.config = config
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * config.data_sampling.num_epochs
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.global_batch_size = (
            self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        )
        self.drop_last = drop_last
        self.generator = torch.Generator().manual_seed(config.seed)
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        #: each cluster's samples (shuffled) and how far it has been read
        self.data_clusters: list[torch.Tensor] = []
        self.data_cluster_current_position: list[int] = []
        self.metrics: dict[str, CurriculumMetricConfig] = dict(
            config.data_sampling.curriculum_learning.curriculum_metrics
        )
        self.curriculum_schedulers = {
            name: CurriculumScheduler(metric.scheduler_config())
            for name, metric in self.metrics.items()
        }
        self._index: dict[str, tuple[list[np.ndarray], np.ndarray | None]] = {}

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(
        self, schedule_func_dict: Mapping[str, Callable[[int], Any]]
    ) -> None:
        """``{metric: fn(step) -> difficulty}`` for the metrics with ``schedule_type: custom``."""
        for name, scheduler in self.curriculum_schedulers.items():
            if name in schedule_func_dict:
                scheduler.set_custom_get_difficulty(schedule_func_dict[name])

    # -- which samples a difficulty admits ------------------------------------------------------
    def _rows(self, name: str) -> tuple[list[np.ndarray], np.ndarray | None]:
        if name not in self._index:
            metric = self.metrics[name]
            samples = MMapIndexedDataset(str(metric.index_to_sample_path))
            rows = [np.array(samples[i], dtype=np.int64) for i in range(len(samples))]
            values = None
            if metric.difficulty_type == "value":
                table = MMapIndexedDataset(str(metric.index_to_metric_path))
                values = np.array([table[i][0] for i in range(len(table))])
            self._index[name] = (rows, values)
        return self._index[name]

    def eligible(self, name: str, difficulty: Any) -> np.ndarray:
        """The samples metric ``name`` admits at ``difficulty`` (sorted ids)."""
        metric = self.metrics[name]
        if metric.clustering_type == "single_cluster":
            return np.arange(self.one_epoch_total_samples, dtype=np.int64)
        rows, values = self._rows(name)
        if values is not None:  # metric value <= difficulty
            picked = [row for row, value in zip(rows, values, strict=True) if value <= difficulty]
        else:  # the first `difficulty` percentiles of the samples in metric order
            ordered = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
            assert metric.max_difficulty is not None
            # floor(N * p / max) samples: DeepSpeed's (N // max) * p admits none at all
            # while N < max (a 60-sample set with percentiles 1..100)
            count = len(ordered) * min(int(difficulty), metric.max_difficulty)
            picked = [ordered[: count // metric.max_difficulty]]
        return np.unique(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)

    def _new_cluster(self) -> None:
        admitted: np.ndarray | None = None
        for name, difficulty in self.current_difficulties.items():
            ids = self.eligible(name, difficulty)
            admitted = ids if admitted is None else np.intersect1d(admitted, ids)
        assert admitted is not None
        for cluster in self.data_clusters:
            admitted = np.setdiff1d(admitted, cluster.numpy())
        if len(admitted) == 0:
            return
        cluster = torch.from_numpy(admitted)
        self.data_clusters.append(cluster[torch.randperm(len(cluster), generator=self.generator)])
        self.data_cluster_current_position.append(0)

    # -- drawing ----------------------------------------------------------------------------------
    def _take(self, cidx: int, count: int) -> list[int]:
        cluster, start = self.data_clusters[cidx], self.data_cluster_current_position[cidx]
        taken = cluster[start : start + count].tolist()
        self.data_cluster_current_position[cidx] = start + len(taken)
        while len(taken) < count:  # used up: reshuffle and go on from its start
            cluster = cluster[torch.randperm(len(cluster), generator=self.generator)]
            self.data_clusters[cidx] = cluster
            more = cluster[: count - len(taken)].tolist()
            taken += more
            self.data_cluster_current_position[cidx] = len(more)
        return taken

    def get_next_global_batch(self) -> None:
        """Advance the curriculum one step and draw the next global batch."""
        self.curriculum_step += 1
        changed = False
        for name, scheduler in self.curriculum_schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)
            changed |= self.current_difficulties.get(name) != difficulty
            self.current_difficulties[name] = difficulty
        if changed:
            self._new_cluster()
        if not self.data_clusters:
            raise ValueError(
                f"curriculum difficulties {self.current_difficulties} admit no sample: raise "
                "min_difficulty (data_efficiency...curriculum_metrics.<metric>.min_difficulty)"
            )
        sizes = torch.tensor([len(c) for c in self.data_clusters], dtype=torch.float64)
        picks = torch.multinomial(sizes, self.global_batch_size, True, generator=self.generator)
        counts = torch.bincount(picks, minlength=len(self.data_clusters)).tolist()
        batch: list[int] = []
        for cidx, count in enumerate(counts):
            batch += self._take(cidx, count)
        order = torch.randperm(len(batch), generator=self.generator).tolist()
        self.batch = [batch[i] for i in order]

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's slice of a micro-batch of ``batch_len`` across the data-parallel ranks."""
        size = batch_len or self.micro_batch_times_data_parallel_size

        def start(rank: int) -> int:
            return round(rank * size / self.data_parallel_size)

        return start(self.data_parallel_rank), start(self.data_parallel_rank + 1)

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current = self.batch[: self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size :]
            if len(current) == self.micro_batch_times_data_parallel_size or (
                current and not self.drop_last
            ):
                start, end = self.get_start_end_idx(len(current))
                self.consumed_samples += len(current)
                yield current[start:end]

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the next draws depend on (DeepSpeed's keys, clusters included)."""
        return {
            "batch": list(self.batch),
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": dict(self.current_difficulties),
            "data_clusters": [c.clone() for c in self.data_clusters],
            "data_cluster_current_position": list(self.data_cluster_current_position),
            "np_rng_state": self.generator.get_state(),
            "curriculum_schedulers": {
                n: s.state_dict() for n, s in self.curriculum_schedulers.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch = list(state["batch"])
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = dict(state["current_difficulties"])
        self.data_clusters = [torch.as_tensor(c) for c in state["data_clusters"]]
        self.data_cluster_current_position = list(state["data_cluster_current_position"])
        self.generator.set_state(state["np_rng_state"])
        for name, saved in state.get("curriculum_schedulers", {}).items():
            if name in self.curriculum_schedulers:
                self.curriculum_schedulers[name].load_state_dict(saved)
