"""``DataAnalyzer``: index a dataset by a difficulty metric, for the curriculum sampler.

For a ``single_value_per_sample`` metric named ``m`` it writes, under ``save_path/m/``:

* ``m_index_to_metric``: one row per distinct metric value, ascending (the value);
* ``m_index_to_sample``: the same rows, each the ids of the samples with that value;
* ``m_index_to_sample_percentile_merged``: the samples sorted by metric, cut into 100 rows of
  (nearly) equal size (for ``difficulty_type: percentile``);
* ``m_sample_to_metric``: one row, the metric of every sample in dataset order.

An ``accumulate_value_over_samples`` metric (e.g. token counts over the corpus, the first pass
of vocabulary rarity) writes ``m_metric_value``: the sum of its per-batch arrays.

The files are DeepSpeed's names and layout, so the config's ``index_to_sample_path`` /
``index_to_metric_path`` point at them as in DeepSpeed's tutorial. This runs in one process
(``num_workers`` / ``worker_id`` split the map work as DeepSpeed's do, and ``run_reduce``
merges every worker's part).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from shardspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
    MMapIndexedDataset,
    write_indexed_dataset,
)

__all__ = ["DataAnalyzer", "seqlen_metric", "vocab_count_metric", "vocab_rarity_metric"]

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")
PERCENTILE_ROWS = 100


class DataAnalyzer:
    """Compute ``metric_functions`` over ``dataset`` (batched by ``batch_size`` with
    ``collate_fn``) and write the index files the curriculum sampler reads."""

    def __init__(
        self,
        dataset: Dataset,
        num_workers: int = 1,
        worker_id: int = 0,
        num_threads: int = 1,
        num_threads_reduce: int = 1,
        specific_threads: Sequence[int] = (),
        batch_size: int = 1,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[Callable[[Any], Any]] = (),
        metric_types: Sequence[str] = (),
        metric_dtypes: Sequence[Any] = (),
        save_path: str = "./",
        collate_fn: Callable[..., Any] | None = None,
        **unused: Any,
    ) -> None:
        del num_threads, num_threads_reduce, specific_threads, unused  # one thread here
        if not len(metric_names) == len(metric_functions) == len(metric_types):
            raise ValueError(
                "DataAnalyzer: metric_names, metric_functions and metric_types must have one "
                f"entry per metric (got {len(metric_names)}, {len(metric_functions)}, "
                f"{len(metric_types)})"
            )
        bad = [t for t in metric_types if t not in METRIC_TYPES]
        if bad:
            raise ValueError(f"DataAnalyzer: metric_types {bad}; use {list(METRIC_TYPES)}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id {worker_id} outside [0, {num_workers})")
        self.dataset = dataset
        self.num_workers, self.worker_id = num_workers, worker_id
        self.batch_size = batch_size
        self.metric_names = list(metric_names)
        self.metric_functions = list(metric_functions)
        self.metric_types = list(metric_types)
        self.metric_dtypes = list(metric_dtypes) or [np.int64] * len(metric_names)
        self.save_path = Path(save_path)
        self.collate_fn = collate_fn

    # -- map: this worker's share ---------------------------------------------------------------
    def _share(self) -> tuple[int, int]:
        total = len(self.dataset)  # type: ignore[arg-type]  # a map-style dataset
        per = -(-total // self.num_workers)
        return min(self.worker_id * per, total), min((self.worker_id + 1) * per, total)

    def run_map(self) -> None:
        """Compute every metric on this worker's share; writes ``worker<id>`` part files."""
        start, end = self._share()
        loader = DataLoader(
            Subset(self.dataset, range(start, end)),
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self.collate_fn,
        )
        values: list[list[np.ndarray]] = [[] for _ in self.metric_names]
        for batch in loader:
            for m, fn in enumerate(self.metric_functions):
                values[m].append(_numpy(fn(batch)))
        for m, name in enumerate(self.metric_names):
            part = self._folder(name) / f"worker{self.worker_id}_{name}"
            dtype = self.metric_dtypes[m]
            if self.metric_types[m] == "single_value_per_sample":
                rows = [v.reshape(-1) for v in values[m]]
                row = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
                write_indexed_dataset(part, [row], dtype)
            else:
                total = np.sum(np.stack(values[m]), axis=0) if values[m] else np.zeros(0)
                write_indexed_dataset(part, [total], dtype)

    # -- reduce: every worker's parts into the index files ----------------------------------------
    def run_reduce(self) -> None:
        """Merge the workers' parts and write the index files of every metric."""
        for m, name in enumerate(self.metric_names):
            folder, dtype = self._folder(name), self.metric_dtypes[m]
            parts = [
                np.array(MMapIndexedDataset(folder / f"worker{w}_{name}")[0])
                for w in range(self.num_workers)
            ]
            if self.metric_types[m] == "accumulate_value_over_samples":
                total = np.sum(np.stack(parts), axis=0)
                write_indexed_dataset(folder / f"{name}_metric_value", [total], dtype)
                continue
            metric = np.concatenate(parts)
            write_index_files(folder, name, metric, dtype)

    def run(self) -> None:
        """:meth:`run_map` then :meth:`run_reduce` (one worker)."""
        self.run_map()
        self.run_reduce()

    def _folder(self, name: str) -> Path:
        folder = self.save_path / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder


def write_index_files(folder: Path, name: str, metric: np.ndarray, dtype: Any) -> None:
    """The index files of one single-value metric (``metric[i]``: sample ``i``'s value)."""
    ids = np.arange(len(metric), dtype=np.int64)
    order = np.argsort(metric, kind="stable")
    values, starts = np.unique(metric[order], return_index=True)
    rows = np.split(ids[order], starts[1:])
    write_indexed_dataset(
        folder / f"{name}_index_to_metric", [np.array([v]) for v in values], dtype
    )
    write_indexed_dataset(folder / f"{name}_index_to_sample", rows, np.int64)
    merged = np.array_split(ids[order], min(PERCENTILE_ROWS, max(len(ids), 1)))
    write_indexed_dataset(folder / f"{name}_index_to_sample_percentile_merged", merged, np.int64)
    write_indexed_dataset(folder / f"{name}_sample_to_metric", [metric], dtype)


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


# -- metric functions for token datasets (a batch of token-id tensors [batch, seq]) ------------
def _tokens(batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        batch = batch.get("input_ids", batch.get("text"))
    elif isinstance(batch, (list, tuple)):
        batch = batch[0]
    if not isinstance(batch, torch.Tensor):
        raise TypeError("the token metrics read a tensor batch, or input_ids / text / item 0")
    return batch if batch.dim() == 2 else batch.unsqueeze(0)


def seqlen_metric(pad_id: int | None = None) -> Callable[[Any], torch.Tensor]:
    """Per sample: its number of tokens (those not ``pad_id``)."""

    def metric(batch: Any) -> torch.Tensor:
        tokens = _tokens(batch)
        if pad_id is None:
            return torch.full((tokens.size(0),), tokens.size(1), dtype=torch.int64)
        return (tokens != pad_id).sum(dim=1)

    return metric


def vocab_count_metric(vocab_size: int) -> Callable[[Any], torch.Tensor]:
    """Accumulated over samples: how often each token id occurs (vocabulary rarity's pass 1)."""

    def metric(batch: Any) -> torch.Tensor:
        return torch.bincount(_tokens(batch).reshape(-1), minlength=vocab_size)

    return metric


def vocab_rarity_metric(counts: np.ndarray | torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """Per sample: ``-sum(log p(token))`` over its tokens with ``p`` from ``counts`` (the
    ``vocab_count_metric`` result), the vocabulary-rarity difficulty of DeepSpeed's tutorial,
    scaled by 100 and rounded so it indexes as an integer."""
    freq = torch.as_tensor(np.asarray(counts), dtype=torch.float64)
    logp = torch.log(freq.clamp(min=1) / freq.sum())

    def metric(batch: Any) -> torch.Tensor:
        return (-logp[_tokens(batch)].sum(dim=1) * 100).round().to(torch.int64)

    return metric
